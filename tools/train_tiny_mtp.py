#!/usr/bin/env python3
"""Train (or randomly initialise) the multi-token-prediction (MTP) layer of models/tiny-dsv3.

The MTP module follows the DeepSeek-V3 technical report, section 2.2, with depth 1. For a
sequence t_0 .. t_{L-1} and every position i:

    h_i   = the main model's last hidden state at position i, AFTER its final RMSNorm
            (model.norm); this is the "target hidden state" vLLM and SGLang hand to their MTP
            drafters.                                                      [hidden]
    e_i+1 = embed_tokens(t_{i+1})   (the main model's embedding, frozen)   [hidden]
    x_i   = eh_proj( concat[ enorm(e_{i+1}), hnorm(h_i) ] )   embedding first, then hidden
    y_i   = DecoderLayer_4(x)_i     one DeepSeek-V3 decoder layer (MLA + MoE, the config's
            layer index num_hidden_layers = 4), attention causal over the rows 0..i, row i at
            rotary position i
    logits_i = shared_head.head( shared_head.norm(y_i) )    [vocab], predicts t_{i+2}

y_i (before shared_head.norm) is the MTP's own hidden state, the one a chained draft feeds back
in place of h. No row is masked (vLLM zeroes the embedding at position 0; this recipe does not).

Training: the main model (transformers' own DeepseekV3ForCausalLM) is frozen; enorm, hnorm,
eh_proj and the decoder layer train; embed_tokens and shared_head.head are copies of the main
model's embedding and lm_head and stay frozen. Data, tokenizer, optimiser and schedule follow
/work/shared/docs/tiny-models.md (see docs/mtp-checkpoint.md in this repository). The loss is the
cross-entropy of t_{i+2}.

Outputs under --out (only the files that are new or changed, to be copied over the model dirs):
    tiny-dsv3/{config.json, model.safetensors.index.json, model-mtp.safetensors}
    tiny-dsv3-fp8/{config.json, model.safetensors.index.json, model-mtp.safetensors}
    ref/mtp/{mtp.safetensors, mtp.json}  (reference draft outputs; layout in docs/mtp-checkpoint.md)

Example (GPU machine):  python3 tools/train_tiny_mtp.py --device cuda --seconds 150 --out $OUT/mtp
Random init, no training: python3 tools/train_tiny_mtp.py --seconds 0 --out /tmp/mtp
"""
import argparse
import glob
import hashlib
import json
import math
import os
import shutil
import sys
import sysconfig
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MTP_SHARD = "model-mtp.safetensors"
FP8_MAX = 448.0
BLOCK = 128
TOPK = 8


def log(*args):
    print(*args, flush=True)


# ---------------------------------------------------------------- data

def corpus_files(stdlib):
    """Sorted .py files of the standard library, site-packages excluded, split 15:1 by md5(path)."""
    files = []
    for root, dirs, names in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "dist-packages"))
        for n in names:
            if n.endswith(".py"):
                files.append(os.path.relpath(os.path.join(root, n), stdlib))
    files.sort()
    train, held = [], []
    for f in files:
        (held if int(hashlib.md5(f.encode()).hexdigest(), 16) % 16 == 0 else train).append(f)
    return train, held


def encode_files(tok, stdlib, files):
    """Concatenated stream: <|begin_of_text|> (0) + tokens + <|end_of_text|> (1) per file."""
    texts = []
    for f in files:
        with open(os.path.join(stdlib, f), encoding="utf-8", errors="replace") as fh:
            texts.append(fh.read())
    ids = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.append(0)
        ids.extend(enc.ids)
        ids.append(1)
    return torch.tensor(ids, dtype=torch.long)


# ---------------------------------------------------------------- model

def load_main(model_dir, device, dtype=torch.float32):
    from transformers import DeepseekV3ForCausalLM
    # "eager" experts: transformers' per-expert loop, which autocasts like any nn.Linear (its
    # default grouped_mm path casts activations to the weights' dtype instead)
    m = DeepseekV3ForCausalLM.from_pretrained(model_dir, dtype=dtype, experts_implementation="eager")
    m.to(device).eval()
    for p in m.parameters():
        p.requires_grad_(False)
    return m


class MTPLayer(nn.Module):
    """DeepSeek-V3 MTP module of depth 1 (technical report section 2.2); see the module docstring."""

    def __init__(self, config, embed_weight, head_weight):
        super().__init__()
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3DecoderLayer, DeepseekV3RMSNorm, DeepseekV3RotaryEmbedding)
        H, eps = config.hidden_size, config.rms_norm_eps
        self.config = config
        self.enorm = DeepseekV3RMSNorm(H, eps=eps)
        self.hnorm = DeepseekV3RMSNorm(H, eps=eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.layer = DeepseekV3DecoderLayer(config, layer_idx=config.num_hidden_layers)
        self.shared_head_norm = DeepseekV3RMSNorm(H, eps=eps)
        self.rotary_emb = DeepseekV3RotaryEmbedding(config=config)
        # frozen copies of the main model's embedding and lm_head
        self.embed_weight = nn.Parameter(embed_weight.detach().clone(), requires_grad=False)
        self.head_weight = nn.Parameter(head_weight.detach().clone(), requires_grad=False)

    def init_random(self, seed):
        """Normal(0, initializer_range) matrices, unit norms, e_score_correction_bias ~ N(0, 0.05)."""
        g = torch.Generator().manual_seed(seed)
        std = self.config.initializer_range
        for name, p in self.named_parameters():
            if name in ("embed_weight", "head_weight"):
                continue
            with torch.no_grad():
                if name.endswith("norm.weight") or "layernorm" in name:
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * std)
        bias = self.layer.mlp.gate.e_score_correction_bias
        with torch.no_grad():
            bias.copy_(torch.randn(bias.shape, generator=g) * 0.05)

    def forward(self, h, next_ids, position_ids):
        """h [B, T, hidden] post-norm main hidden; next_ids [B, T] = t_{i+1}; position_ids [B, T].
        Returns (logits [B, T, vocab] for t_{i+2}, y [B, T, hidden] the MTP's pre-norm output)."""
        from transformers.masking_utils import create_causal_mask
        e = F.embedding(next_ids, self.embed_weight)
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(h)], dim=-1))
        mask = create_causal_mask(config=self.config, inputs_embeds=x, attention_mask=None,
                                  past_key_values=None, position_ids=position_ids)
        pe = self.rotary_emb(x, position_ids=position_ids)
        y = self.layer(x, attention_mask=mask, position_ids=position_ids, position_embeddings=pe)
        logits = F.linear(self.shared_head_norm(y), self.head_weight)
        return logits, y

    # -- hub layout (DeepSeek-V3 checkpoints: model.layers.<num_hidden_layers>.*)
    def hub_state(self, prefix):
        """MTP tensors in the hub's per-expert layout, float32 (bias float32 as in the checkpoint)."""
        L = self.layer
        out = {
            prefix + "enorm.weight": self.enorm.weight,
            prefix + "hnorm.weight": self.hnorm.weight,
            prefix + "eh_proj.weight": self.eh_proj.weight,
            prefix + "embed_tokens.weight": self.embed_weight,
            prefix + "shared_head.norm.weight": self.shared_head_norm.weight,
            prefix + "shared_head.head.weight": self.head_weight,
        }
        for n, t in L.state_dict().items():
            if n.startswith("mlp.experts."):
                continue
            out[prefix + n] = t
        I = self.config.moe_intermediate_size
        ex = L.mlp.experts
        for e in range(ex.num_experts):
            out[prefix + f"mlp.experts.{e}.gate_proj.weight"] = ex.gate_up_proj[e, :I]
            out[prefix + f"mlp.experts.{e}.up_proj.weight"] = ex.gate_up_proj[e, I:]
            out[prefix + f"mlp.experts.{e}.down_proj.weight"] = ex.down_proj[e]
        return {k: v.detach().float().cpu().contiguous() for k, v in out.items()}

    def load_hub_state(self, sd, prefix):
        """Inverse of hub_state; raises KeyError naming a missing tensor."""
        def get(k):
            if prefix + k not in sd:
                raise KeyError(f"MTP tensor {prefix + k} missing from the checkpoint")
            return sd[prefix + k].float()
        with torch.no_grad():
            self.enorm.weight.copy_(get("enorm.weight"))
            self.hnorm.weight.copy_(get("hnorm.weight"))
            self.eh_proj.weight.copy_(get("eh_proj.weight"))
            self.embed_weight.copy_(get("embed_tokens.weight"))
            self.shared_head_norm.weight.copy_(get("shared_head.norm.weight"))
            self.head_weight.copy_(get("shared_head.head.weight"))
            lsd = {}
            for n in self.layer.state_dict():
                if not n.startswith("mlp.experts."):
                    lsd[n] = get(n)
            ex = self.layer.mlp.experts
            lsd["mlp.experts.gate_up_proj"] = torch.stack([
                torch.cat([get(f"mlp.experts.{e}.gate_proj.weight"), get(f"mlp.experts.{e}.up_proj.weight")])
                for e in range(ex.num_experts)])
            lsd["mlp.experts.down_proj"] = torch.stack(
                [get(f"mlp.experts.{e}.down_proj.weight") for e in range(ex.num_experts)])
            self.layer.load_state_dict(lsd, strict=True)


# ---------------------------------------------------------------- checkpoint writing

def read_checkpoint(model_dir):
    sd = {}
    for f in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        sd.update(load_file(f))
    return sd


def quantize_fp8_block(w):
    """e4m3 with one float32 weight_scale_inv per 128x128 block: scale = amax(block) / 448,
    q = e4m3(w / scale); the same rule as models/tiny-dsv3-fp8's other weights."""
    w = w.float()
    R, C = w.shape
    nr, nc = (R + BLOCK - 1) // BLOCK, (C + BLOCK - 1) // BLOCK
    pad = torch.zeros(nr * BLOCK, nc * BLOCK)
    pad[:R, :C] = w
    amax = pad.view(nr, BLOCK, nc, BLOCK).abs().amax(dim=(1, 3))
    scale = amax / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    full = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:R, :C]
    q = (w / full).to(torch.float8_e4m3fn)
    return q, scale.contiguous()


def dequantize_fp8_block(q, scale):
    R, C = q.shape
    full = scale.float().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:R, :C]
    return q.float() * full


def write_model_dir(base_dir, out_dir, mtp_sd, fp8):
    """Writes config.json (num_nextn_predict_layers 1), the index with the new shard, and the shard.
    Dtypes follow base_dir's own tensors: bf16 except e_score_correction_bias (f32); with fp8 the
    linear weights of attention, experts, shared experts and eh_proj become e4m3 + weight_scale_inv."""
    os.makedirs(out_dir, exist_ok=True)
    base_sd_keys = json.load(open(os.path.join(base_dir, "model.safetensors.index.json")))["weight_map"]
    tensors = {}
    for k, v in mtp_sd.items():
        if k in base_sd_keys:
            raise RuntimeError(f"{base_dir} already holds {k}; refusing to overwrite an MTP layer")
        if k.endswith("e_score_correction_bias"):
            tensors[k] = v.float().contiguous()
            continue
        linear = v.dim() == 2 and not any(s in k for s in (
            "embed_tokens", "shared_head.head", "mlp.gate.weight"))
        if fp8 and linear:
            q, s = quantize_fp8_block(v)
            tensors[k] = q.contiguous()
            tensors[k + "_scale_inv"] = s
        else:
            tensors[k] = v.to(torch.bfloat16).contiguous()
    save_file(tensors, os.path.join(out_dir, MTP_SHARD), metadata={"format": "pt"})
    with open(os.path.join(base_dir, "model.safetensors.index.json")) as fh:
        index = json.load(fh)
    for k in sorted(tensors):
        index["weight_map"][k] = MTP_SHARD
    index["metadata"]["total_size"] = int(index["metadata"]["total_size"]) + sum(
        t.numel() * t.element_size() for t in tensors.values())
    index["weight_map"] = dict(sorted(index["weight_map"].items()))
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as fh:
        json.dump(index, fh, indent=2)
        fh.write("\n")
    with open(os.path.join(base_dir, "config.json")) as fh:
        raw = fh.read()
    cfg = json.loads(raw)
    cfg["num_nextn_predict_layers"] = 1
    with open(os.path.join(out_dir, "config.json"), "w") as fh:
        json.dump(cfg, fh, indent=2)
        if raw.endswith("\n"):
            fh.write("\n")


def assemble(base_dir, new_dir, dest):
    """Full model dir = base_dir's files overlaid with new_dir's."""
    shutil.copytree(base_dir, dest)
    for f in os.listdir(new_dir):
        shutil.copy(os.path.join(new_dir, f), os.path.join(dest, f))


def dequantized_copy(fp8_dir, dest):
    """A float32 copy of an FP8 block-quantized checkpoint (config without quantization_config),
    so transformers can run it on the CPU in float32."""
    os.makedirs(dest)
    sd = read_checkpoint(fp8_dir)
    out = {}
    for k, v in sd.items():
        if k.endswith("_scale_inv"):
            continue
        out[k] = dequantize_fp8_block(v, sd[k + "_scale_inv"]) if k + "_scale_inv" in sd else v.float()
    save_file(out, os.path.join(dest, "model.safetensors"), metadata={"format": "pt"})
    cfg = json.load(open(os.path.join(fp8_dir, "config.json")))
    cfg.pop("quantization_config", None)
    json.dump(cfg, open(os.path.join(dest, "config.json"), "w"), indent=2)
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if os.path.exists(os.path.join(fp8_dir, f)):
            shutil.copy(os.path.join(fp8_dir, f), os.path.join(dest, f))
    return out


# ---------------------------------------------------------------- training

def batch_windows(stream, B, T, gen, device):
    """B random windows of T+2 tokens: the main model reads [:T], the MTP predicts [2:T+2]."""
    starts = torch.randint(0, stream.numel() - (T + 2), (B,), generator=gen)
    idx = starts[:, None] + torch.arange(T + 2)[None, :]
    return stream[idx].to(device)


def mtp_step(main, mtp, w, T, autocast_dtype, device):
    """Returns (mtp logits [B, T, V], main greedy next-next ids [B, T])."""
    B = w.shape[0]
    pos = torch.arange(T, device=device)[None, :].expand(B, T)
    with torch.autocast(device_type=device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        with torch.no_grad():
            out = main.model(input_ids=w[:, :T + 1])
            h = out.last_hidden_state[:, :T].float()
            main_next2 = main.lm_head(out.last_hidden_state[:, 1:T + 1]).argmax(-1)
        logits, _ = mtp(h, w[:, 1:T + 1], pos)
    return logits.float(), main_next2


def evaluate(main, mtp, windows, T, autocast_dtype, device, bs):
    mtp.eval()
    tot_loss, n, acc_main, acc_data = 0.0, 0, 0, 0
    with torch.no_grad():
        for s in range(0, windows.shape[0], bs):
            w = windows[s:s + bs].to(device)
            logits, main_next2 = mtp_step(main, mtp, w, T, autocast_dtype, device)
            tgt = w[:, 2:T + 2]
            tot_loss += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1),
                                        reduction="sum").item()
            pred = logits.argmax(-1)
            acc_main += (pred == main_next2).sum().item()
            acc_data += (pred == tgt).sum().item()
            n += tgt.numel()
    mtp.train()
    return {"eval_loss": tot_loss / n, "accept_vs_main_greedy": acc_main / n,
            "top1_vs_data": acc_data / n, "eval_positions": n}


def lr_at(step, elapsed, args):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    if args.steps > 0:
        p = (step - args.warmup) / max(1, args.steps - args.warmup)
    else:
        p = elapsed / max(1e-9, args.seconds)
    p = min(max(p, 0.0), 1.0)
    return args.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * p)))


def train(main, mtp, train_stream, eval_windows, args, device):
    autocast_dtype = torch.bfloat16 if device.type == "cuda" else None
    params = [p for p in mtp.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(args.seed + 1)
    T = args.seq
    history = []
    before = evaluate(main, mtp, eval_windows, T, autocast_dtype, device, args.batch)
    log(f"step 0 (random init): {json.dumps(before)}")
    mtp.train()
    t0 = time.time()
    step = 0
    while True:
        elapsed = time.time() - t0
        if args.steps > 0 and step >= args.steps:
            break
        if args.steps <= 0 and elapsed >= args.seconds:
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(step, elapsed, args)
        w = batch_windows(train_stream, args.batch, T, gen, device)
        logits, _ = mtp_step(main, mtp, w, T, autocast_dtype, device)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 2:T + 2].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % args.log_every == 0:
            history.append({"step": step, "t": round(elapsed, 1), "loss": round(loss.item(), 4),
                            "grad_norm": round(gn.item(), 3), "lr": opt.param_groups[0]["lr"]})
            log(json.dumps(history[-1]))
        step += 1
    after = evaluate(main, mtp, eval_windows, T, autocast_dtype, device, args.batch)
    log(f"step {step} ({time.time() - t0:.1f} s): {json.dumps(after)}")
    return {"steps": step, "seconds": round(time.time() - t0, 1), "before": before, "after": after,
            "history": history}


# ---------------------------------------------------------------- references and checks

def logits_identical_check(base_dir, mtp_dir, cases, name):
    """transformers must run the checkpoint with the MTP layer exactly as without it."""
    a = load_main(base_dir, torch.device("cpu"))
    b = load_main(mtp_dir, torch.device("cpu"))
    for j, c in enumerate(cases):
        ids = torch.tensor([c["prompt_token_ids"]])
        with torch.no_grad():
            la, lb = a(ids).logits, b(ids).logits
        if not torch.equal(la, lb):
            raise RuntimeError(f"{name} prompt {j}: logits change when the MTP layer is present "
                               f"(max diff {(la - lb).abs().max().item()})")
    log(f"{name}: transformers logits with the MTP layer are bit-identical on {len(cases)} prompts")
    return b


def crosscheck(mtp, main, cases):
    """The MTP's decoder layer, shared_head.norm and head run again as a one-layer
    DeepseekV3ForCausalLM (first_k_dense_replace 0, so the layer is an MoE) on inputs_embeds =
    eh_proj(...): its own causal mask and rotary embedding must give the same logits."""
    import copy
    from transformers import DeepseekV3ForCausalLM
    cfg = copy.deepcopy(mtp.config)
    cfg.num_hidden_layers, cfg.first_k_dense_replace = 1, 0
    one = DeepseekV3ForCausalLM(cfg).float().eval()
    sd = {"model.layers.0." + k: v for k, v in mtp.layer.state_dict().items()}
    sd.update({"model.norm.weight": mtp.shared_head_norm.weight, "lm_head.weight": mtp.head_weight,
               "model.embed_tokens.weight": mtp.embed_weight})
    missing, unexpected = one.load_state_dict(sd, strict=False)
    if [k for k in missing if "rotary" not in k] or unexpected:
        raise RuntimeError(f"crosscheck: missing {missing}, unexpected {unexpected}")
    worst = 0.0
    for c in cases:
        ids = torch.tensor([c["prompt_token_ids"] + c["greedy_token_ids"]])
        with torch.no_grad():
            h = main.model(input_ids=ids).last_hidden_state[:, :-1]
            e = F.embedding(ids[:, 1:], mtp.embed_weight)
            x = mtp.eh_proj(torch.cat([mtp.enorm(e), mtp.hnorm(h)], dim=-1))
            a = one(inputs_embeds=x).logits
            b, _ = mtp(h, ids[:, 1:], torch.arange(h.shape[1])[None, :])
        worst = max(worst, (a - b).abs().max().item())
    if worst > 1e-4:
        raise RuntimeError(f"crosscheck: MTP logits differ from a one-layer transformers model by {worst}")
    log(f"crosscheck against a one-layer transformers model: max |diff| {worst:.2e}")
    return worst


def ref_outputs(main, mtp, cases, name, ref_logits, full_logit_prompts):
    """Per prompt: tokens = prompt_token_ids + greedy_token_ids (length L); MTP rows i = 0..L-2 with
    h_i from the main model over tokens[:i+1] and t_{i+1} = tokens[i+1]."""
    out, meta = {}, []
    for j, c in enumerate(cases):
        toks = c["prompt_token_ids"] + c["greedy_token_ids"]
        ids = torch.tensor([toks])
        L = len(toks)
        with torch.no_grad():
            o = main.model(input_ids=ids)
            h = o.last_hidden_state
            main_logits = main.lm_head(h)
            pos = torch.arange(L - 1)[None, :]
            logits, y = mtp(h[:, :L - 1], ids[:, 1:], pos)
        logits, y = logits[0].float(), y[0].float()
        P = len(c["prompt_token_ids"])
        key = f"{name}.prompt{j}"
        ref = ref_logits.get(f"{key}.logits")
        main_diff = None
        if ref is not None:
            main_diff = (main_logits[0, :ref.shape[0]] - ref).abs().max().item()
        vals, idx = logits.topk(TOPK, dim=-1)
        out[f"{key}.tokens"] = torch.tensor(toks, dtype=torch.int32)
        out[f"{key}.draft_argmax"] = logits.argmax(-1).to(torch.int32)
        out[f"{key}.draft_topk_ids"] = idx.to(torch.int32).contiguous()
        out[f"{key}.draft_topk_logits"] = vals.contiguous()
        out[f"{key}.main_argmax"] = main_logits[0].argmax(-1).to(torch.int32)
        if j in full_logit_prompts:
            out[f"{key}.draft_logits"] = logits[:P - 1].contiguous()
            out[f"{key}.draft_hidden"] = y[:P - 1].contiguous()
        d = logits.argmax(-1)
        nxt2 = main_logits[0, 1:].argmax(-1)
        meta.append({"prompt": j, "tokens": L, "prompt_tokens": P, "rows": L - 1,
                     "main_logits_vs_models_ref_max_abs": main_diff,
                     "draft_argmax_eq_main_greedy": (d == nxt2).float().mean().item(),
                     "draft_argmax_eq_token": (d[:L - 2] == ids[0, 2:]).float().mean().item()})
    return out, meta


def main_():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="output folder (new/changed files only)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seconds", type=float, default=150.0, help="training wall-time budget; 0 = random init")
    ap.add_argument("--steps", type=int, default=0, help="train a fixed number of steps instead of --seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--eval-windows", type=int, default=64)
    ap.add_argument("--max-files", type=int, default=0, help="use only the first N corpus files (smoke runs)")
    ap.add_argument("--stdlib", default=sysconfig.get_paths()["stdlib"])
    ap.add_argument("--models", default=os.path.join(REPO, "models"))
    args = ap.parse_args()
    if args.seconds < 0 or args.steps < 0:
        sys.exit("error: --seconds and --steps must be >= 0")
    if args.batch < 1 or args.seq < 2:
        sys.exit("error: --batch must be >= 1 and --seq >= 2")
    bf16_dir = os.path.join(args.models, "tiny-dsv3")
    fp8_dir = os.path.join(args.models, "tiny-dsv3-fp8")
    for d in (bf16_dir, fp8_dir):
        if not os.path.exists(os.path.join(d, "config.json")):
            sys.exit(f"error: no checkpoint at {d}")
        if json.load(open(os.path.join(d, "config.json"))).get("num_nextn_predict_layers", 0):
            sys.exit(f"error: {d} already has an MTP layer (num_nextn_predict_layers != 0)")
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    log(f"torch {torch.__version__}, device {device}, python {sys.version.split()[0]}")

    main = load_main(bf16_dir, device)
    cfg = main.config
    prefix = f"model.layers.{cfg.num_hidden_layers}."
    mtp = MTPLayer(cfg, main.model.embed_tokens.weight, main.lm_head.weight)
    mtp.init_random(args.seed)
    mtp.to(device)
    log(f"attention {cfg._attn_implementation}, experts {mtp.layer.mlp.experts.config._experts_implementation}")

    report = {"args": vars(args), "torch": torch.__version__}
    train_on = args.seconds > 0 or args.steps > 0
    if train_on:
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(os.path.join(bf16_dir, "tokenizer.json"))
        tr_files, held_files = corpus_files(args.stdlib)
        if args.max_files:
            tr_files, held_files = tr_files[:args.max_files], held_files[:max(1, args.max_files // 15)]
        t0 = time.time()
        train_stream = encode_files(tok, args.stdlib, tr_files)
        held_stream = encode_files(tok, args.stdlib, held_files)
        log(f"corpus {args.stdlib}: {len(tr_files)} train files ({train_stream.numel()} tokens), "
            f"{len(held_files)} held out ({held_stream.numel()} tokens), tokenized in {time.time() - t0:.1f} s")
        W = args.seq + 2
        nwin = min(args.eval_windows, held_stream.numel() // W)
        if nwin < 1 or train_stream.numel() < W + 1:
            sys.exit("error: corpus too small for one window")
        stride = held_stream.numel() // nwin
        eval_windows = torch.stack([held_stream[k * stride:k * stride + W] for k in range(nwin)])
        report["corpus"] = {"stdlib": args.stdlib, "train_files": len(tr_files), "held_files": len(held_files),
                            "train_tokens": train_stream.numel(), "held_tokens": held_stream.numel()}
        report["training"] = train(main, mtp, train_stream, eval_windows, args, device)

    mtp_sd = mtp.hub_state(prefix)
    new_bf16 = os.path.join(args.out, "tiny-dsv3")
    new_fp8 = os.path.join(args.out, "tiny-dsv3-fp8")
    write_model_dir(bf16_dir, new_bf16, mtp_sd, fp8=False)
    fp8_sd = read_checkpoint(fp8_dir)
    for k in ("embed_tokens.weight", "shared_head.head.weight"):  # the fp8 copy's own tensors
        src = "model.embed_tokens.weight" if k.startswith("embed") else "lm_head.weight"
        mtp_sd_k = fp8_sd[src].float()
        mtp_sd[prefix + k] = mtp_sd_k
    write_model_dir(fp8_dir, new_fp8, mtp_sd, fp8=True)
    log(f"wrote {new_bf16} and {new_fp8}")

    # Checks and references, float32 on the CPU, from what was written.
    del main
    cases = json.load(open(os.path.join(args.models, "ref", "cases.json")))
    ref_logits = load_file(os.path.join(args.models, "ref", "logits.safetensors"))
    ref, meta = {}, {}
    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))
    with tempfile.TemporaryDirectory() as tmp:
        for name, base, new, fp8 in (("tiny-dsv3", bf16_dir, new_bf16, False),
                                     ("tiny-dsv3-fp8", fp8_dir, new_fp8, True)):
            full = os.path.join(tmp, name)
            assemble(base, new, full)
            if fp8:
                # transformers' FP8 path needs a GPU; compare float32 dequantized copies instead
                base = os.path.join(tmp, name + "-base-f32")
                dequantized_copy(fp8_dir, base)
                f32 = os.path.join(tmp, name + "-f32")
                sd = dequantized_copy(full, f32)
            else:
                f32 = full
                sd = read_checkpoint(full)
            m = logits_identical_check(base, f32, cases[name], name)
            ck = MTPLayer(m.config, m.model.embed_tokens.weight, m.lm_head.weight)
            ck.load_hub_state(sd, prefix)
            ck.eval()
            meta[name + ".crosscheck_max_abs"] = crosscheck(ck, m, cases[name])
            r, mm = ref_outputs(m, ck, cases[name], name, ref_logits, full_logit_prompts={0})
            ref.update(r)
            meta[name] = mm
            log(f"{name}: " + json.dumps(mm))
    os.makedirs(os.path.join(args.out, "ref", "mtp"), exist_ok=True)
    save_file(ref, os.path.join(args.out, "ref", "mtp", "mtp.safetensors"),
              metadata={"format": "pt", "produced_by": f"tools/train_tiny_mtp.py, torch {torch.__version__}, "
                        "float32 CPU", "trained": str(train_on)})
    report["ref"] = meta
    report["layout"] = ("see docs/mtp-checkpoint.md; per model M and prompt j: M.promptj.tokens [L] i32, "
                        "draft_argmax [L-1] i32, draft_topk_ids/logits [L-1, 8], main_argmax [L] i32, "
                        "prompt0 also draft_logits/draft_hidden [P-1, ...] f32")
    with open(os.path.join(args.out, "ref", "mtp", "mtp.json"), "w") as fh:
        json.dump(report, fh, indent=1)
        fh.write("\n")
    log(f"wrote {os.path.join(args.out, 'ref', 'mtp')}/mtp.safetensors and mtp.json")


if __name__ == "__main__":
    main_()
