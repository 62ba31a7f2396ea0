#!/usr/bin/env python3
"""lm-eval (PyPI `lm-eval`, model `local-completions`) against `nucleus serve` (tiny model, CPU).

Run by ctest (env NUCLEUS_BIN, NUCLEUS_MODELS_DIR, NUCLEUS_LM_EVAL_VENV):
  lm_eval_test.py --setup   creates the venv NUCLEUS_LM_EVAL_VENV and installs `lm-eval[api]` and
                            `transformers` (lm-eval tokenizes with the model's tokenizer.json)
  lm_eval_test.py           checks the prompt logprobs lm-eval's loglikelihood requests rely on
                            (echo + logprobs, prompt_logprobs) against the Hugging Face reference
                            logits in models/ref and against the sampler's logprobs, then runs
                            lm_eval on the local tasks in tests/lm_eval_tasks (a multiple-choice
                            loglikelihood task and a generate_until task), prints its table and
                            checks its loglikelihoods against direct requests.
The tiny model's scores are poor; what is checked is that the run completes with numeric
metrics and that the numbers it is built from are right.
"""
import array
import glob
import json
import math
import os
import struct
import subprocess
import sys
import tempfile
import unittest
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from openai_client_test import Server  # noqa: E402

VENV = os.environ.get("NUCLEUS_LM_EVAL_VENV", os.path.join(tempfile.gettempdir(), "nucleus-lm-eval-venv"))
VENV_PYTHON = os.path.join(VENV, "bin", "python")
TASKS = os.path.join(os.path.dirname(HERE), "lm_eval_tasks")


def setup_venv():
    if os.path.exists(VENV_PYTHON) and subprocess.run(
            [VENV_PYTHON, "-c", "import lm_eval, tenacity, aiohttp, transformers"], capture_output=True).returncode == 0:
        return 0
    subprocess.run([sys.executable, "-m", "venv", VENV], check=True)
    return subprocess.run([VENV_PYTHON, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "lm-eval[api]",
                           "transformers"]).returncode


def read_safetensors(path, name):
    """Tensor `name` (F32) of a .safetensors file as (shape, flat array('f'))."""
    with open(path, "rb") as f:
        header_len = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(header_len))
        t = header[name]
        assert t["dtype"] == "F32"
        begin, end = t["data_offsets"]
        f.seek(8 + header_len + begin)
        data = array.array("f")
        data.frombytes(f.read(end - begin))
        assert sys.byteorder == "little"
        return t["shape"], data


def reference_prompt_logprobs(case_index):
    """log_softmax(HF logits[p])[prompt[p + 1]] for every p of a models/ref case with full logits."""
    models = os.environ["NUCLEUS_MODELS_DIR"]
    with open(os.path.join(models, "ref", "cases.json")) as f:
        case = json.load(f)["tiny-dsv3"][case_index]
    (n, vocab), logits = read_safetensors(os.path.join(models, "ref", "logits.safetensors"),
                                          f"tiny-dsv3.prompt{case_index}.logits")
    ids = case["prompt_token_ids"]
    assert n == len(ids)
    out = []
    for p in range(n - 1):
        row = logits[p * vocab:(p + 1) * vocab]
        m = max(row)
        log_z = m + math.log(sum(math.exp(x - m) for x in row))
        out.append(row[ids[p + 1]] - log_z)
    return ids, out


class LmEvalTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = Server()
        cls.base = f"http://127.0.0.1:{cls.server.port}"

    @classmethod
    def tearDownClass(cls):
        status = cls.server.terminate()
        assert status == 0, f"server exit status {status}:\n{cls.server.output()}"

    def post(self, body):
        req = urllib.request.Request(self.base + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.load(r)

    def test_echo_logprobs_match_reference(self):
        """What lm-eval sends for loglikelihood (echo, logprobs 1, max_tokens 1), and max_tokens 0."""
        worst = 0.0
        for case_index in (0, 1):
            ids, ref = reference_prompt_logprobs(case_index)
            for max_tokens in (0, 1):
                r = self.post({"model": "tiny-dsv3", "prompt": ids, "echo": True, "logprobs": 1,
                               "max_tokens": max_tokens, "temperature": 0, "seed": 1234})
                lp = r["choices"][0]["logprobs"]
                self.assertEqual(len(lp["tokens"]), len(ids) + max_tokens)
                self.assertIsNone(lp["token_logprobs"][0])
                self.assertIsNone(lp["top_logprobs"][0])
                self.assertEqual(r["usage"]["completion_tokens"], max_tokens)
                for p, expected in enumerate(ref):
                    got = lp["token_logprobs"][p + 1]
                    self.assertLess(abs(got - expected), 2e-2, f"case {case_index} position {p}")
                    worst = max(worst, abs(got - expected))
                    top = lp["top_logprobs"][p + 1]
                    self.assertLessEqual(len(top), 2)  # the top-1 and the prompt token
                    self.assertGreaterEqual(max(top.values()), got - 1e-6)
                # text_offset: characters of the text before each token (the BOS is skipped: none)
                text = r["choices"][0]["text"]
                offsets = lp["text_offset"]
                self.assertEqual(offsets, sorted(offsets))
                self.assertLessEqual(offsets[-1], len(text))
                if max_tokens == 0:
                    self.assertEqual(r["choices"][0]["finish_reason"], "length")
        print(f"\necho logprobs vs Hugging Face reference: max |difference| {worst:.3g}")

    def test_prompt_logprobs_field_matches_echo(self):
        ids, ref = reference_prompt_logprobs(0)
        r = self.post({"prompt": ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2})
        plp = r["choices"][0]["prompt_logprobs"]
        self.assertEqual(len(plp), len(ids))
        self.assertIsNone(plp[0])
        for p, expected in enumerate(ref):
            entry = plp[p + 1]
            mine = entry[str(ids[p + 1])]
            self.assertLess(abs(mine["logprob"] - expected), 2e-2)
            self.assertGreaterEqual(mine["rank"], 1)
            ranks = sorted(v["rank"] for k, v in entry.items() if k != str(ids[p + 1]) or v["rank"] <= 2)
            self.assertEqual(ranks[:2], [1, 2])

    def test_prompt_rows_agree_with_sampling_rows(self):
        """The sampler's logprob of its greedy token (the last position's row) equals the prompt
        logprob of the rank-1 token at that position when the prompt goes on (a prompt row)."""
        ids, _ = reference_prompt_logprobs(1)
        for k in (5, 40, 85):
            g = self.post({"prompt": ids[:k], "max_tokens": 1, "temperature": 0, "logprobs": 0})
            sampled = g["choices"][0]["logprobs"]
            e = self.post({"prompt": ids[:k + 1], "max_tokens": 1, "temperature": 0, "prompt_logprobs": 1})
            best = [v for v in e["choices"][0]["prompt_logprobs"][k].values() if v["rank"] == 1]
            self.assertEqual(len(best), 1)
            self.assertEqual(best[0]["decoded_token"], sampled["tokens"][0])
            self.assertAlmostEqual(best[0]["logprob"], sampled["token_logprobs"][0], delta=1e-4)

    def test_lm_eval_run(self):
        out = tempfile.mkdtemp(prefix="nucleus_lm_eval_")
        model_dir = os.path.join(os.environ["NUCLEUS_MODELS_DIR"], "tiny-dsv3")
        env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   HF_HOME=os.path.join(out, "hf_home"), TOKENIZERS_PARALLELISM="false")
        cmd = [os.path.join(VENV, "bin", "lm_eval"), "--model", "local-completions", "--model_args",
               f"base_url={self.base}/v1/completions,model=tiny-dsv3,tokenizer_backend=huggingface,"
               f"tokenizer={model_dir},max_length=1024,max_retries=1",
               "--tasks", "nucleus_tiny_mc,nucleus_tiny_gen", "--include_path", TASKS,
               "--output_path", out, "--log_samples", "--seed", "1234"]
        print("\n$ " + " ".join(cmd))
        r = subprocess.run(cmd, cwd=TASKS, env=env, capture_output=True, text=True, timeout=900)
        print(r.stdout)
        if r.returncode != 0:
            print(r.stderr[-20000:])
        self.assertEqual(r.returncode, 0)
        results_files = glob.glob(os.path.join(out, "**", "results_*.json"), recursive=True)
        self.assertEqual(len(results_files), 1, results_files)
        with open(results_files[0]) as f:
            results = json.load(f)["results"]
        for task, metric in (("nucleus_tiny_mc", "acc,none"), ("nucleus_tiny_mc", "acc_norm,none"),
                             ("nucleus_tiny_gen", "exact_match,none")):
            value = results[task][metric]
            self.assertIsInstance(value, (int, float), f"{task} {metric}")
            self.assertTrue(0.0 <= value <= 1.0, f"{task} {metric} = {value}")
        # lm-eval's loglikelihoods against the same (context, continuation)
        # tokens scored directly through prompt_logprobs.
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(model_dir)
        samples = glob.glob(os.path.join(out, "**", "samples_nucleus_tiny_mc_*.jsonl"), recursive=True)
        self.assertEqual(len(samples), 1, samples)
        checked = 0
        with open(samples[0]) as f:
            for line in f:
                s = json.loads(line)
                args = s["arguments"]  # {"gen_args_0": {"arg_0": context, "arg_1": continuation}, ...}
                pairs = [(a["arg_0"], a["arg_1"]) for a in args.values()] if isinstance(args, dict) else args
                for (context, continuation), resp in zip(pairs, s["resps"]):
                    whole = tok(context + continuation, add_special_tokens=False).input_ids
                    ctx = tok(context, add_special_tokens=False).input_ids
                    cont = whole[len(ctx):]
                    if whole[:len(ctx)] != ctx or not cont:
                        continue  # lm-eval splits such pairs differently; not compared
                    r2 = self.post({"prompt": whole, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0})
                    plp = r2["choices"][0]["prompt_logprobs"]
                    direct = sum(plp[i][str(whole[i])]["logprob"] for i in range(len(ctx), len(whole)))
                    greedy = all(plp[i][str(whole[i])]["rank"] == 1 for i in range(len(ctx), len(whole)))
                    ll, is_greedy = float(resp[0][0]), resp[0][1] in (True, "True")  # as strings
                    self.assertAlmostEqual(ll, direct, delta=1e-3, msg=f"{context!r} + {continuation!r}")
                    self.assertEqual(is_greedy, greedy, f"{context!r} + {continuation!r}")
                    checked += 1
        print(f"lm-eval loglikelihoods equal to direct prompt_logprobs sums: {checked} (context, continuation) pairs")
        self.assertGreater(checked, 10)
        # generate_until: lm-eval's text is the server's greedy completion up to the newline.
        samples = glob.glob(os.path.join(out, "**", "samples_nucleus_tiny_gen_*.jsonl"), recursive=True)
        self.assertEqual(len(samples), 1, samples)
        with open(samples[0]) as f:
            docs = [json.loads(line) for line in f]
        self.assertEqual(len(docs), 6)
        for s in docs[:3]:
            context = list(s["arguments"].values())[0]["arg_0"]
            r2 = self.post({"prompt": tok(context, add_special_tokens=False).input_ids, "max_tokens": 16,
                            "temperature": 0, "stop": ["\n"]})
            self.assertEqual(s["resps"][0][0], r2["choices"][0]["text"], context)


def main():
    if "--setup" in sys.argv:
        return setup_venv()
    if os.path.realpath(sys.prefix) != os.path.realpath(VENV):  # run inside the venv (transformers)
        if setup_venv() != 0:
            print("could not install lm-eval", file=sys.stderr)
            return 1
        return subprocess.run([VENV_PYTHON, os.path.abspath(__file__)] + sys.argv[1:]).returncode
    result = unittest.main(exit=False, verbosity=2).result
    print(f"{result.testsRun - len(result.failures) - len(result.errors)} passed, "
          f"{len(result.failures) + len(result.errors)} failed")
    return 0 if result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main())
