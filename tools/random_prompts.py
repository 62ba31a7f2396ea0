#!/usr/bin/env python3
"""Random token-id prompts as JSONL ({"prompt_token_ids": [...]} per line) for
`nucleus generate --prompts`, optionally sharing a common prefix (to measure
the prefix cache). Token ids are drawn from [3, vocab)."""
import argparse
import json
import random

ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("--num", type=int, required=True, help="number of prompts")
ap.add_argument("--len", type=int, required=True, help="tokens per prompt")
ap.add_argument("--vocab", type=int, required=True, help="vocabulary size of the model")
ap.add_argument("--shared-prefix", type=int, default=0, help="leading tokens every prompt shares")
ap.add_argument("--seed", type=int, default=0)
a = ap.parse_args()
if not 0 <= a.shared_prefix <= a.len:
    ap.error("--shared-prefix must be within [0, --len]")
rng = random.Random(a.seed)
prefix = [rng.randrange(3, a.vocab) for _ in range(a.shared_prefix)]
for _ in range(a.num):
    ids = prefix + [rng.randrange(3, a.vocab) for _ in range(a.len - a.shared_prefix)]
    print(json.dumps({"prompt_token_ids": ids}))
