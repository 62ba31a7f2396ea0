// The MoE routing vocabulary shared by the config reader (io/hf_config.h:
// config.json's scoring_func and topk_method) and the routing kernels
// (kernels/moe/moe_ref.h, which must not depend on io/).
#pragma once

namespace nucleus {

// How router logits become scores: softmax over experts (DeepSeek-V2) or an
// element-wise sigmoid (DeepSeek-V3).
enum class ScoringFunc { kSoftmax, kSigmoid };
// How experts are chosen (semantics: kernels/moe/moe_ref.h): plain top-k
// ("greedy"), top-k within the best groups by their max ("group_limited_greedy"),
// or by the sum of their top-2 biased scores ("noaux_tc").
enum class TopkMethod { kGreedy, kGroupLimitedGreedy, kNoauxTc };

}  // namespace nucleus
