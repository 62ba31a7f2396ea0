#!/usr/bin/env python3
"""The official OpenAI Python client against `nucleus serve` (tiny model, CPU).

Run by ctest (env NUCLEUS_BIN, NUCLEUS_MODELS_DIR, NUCLEUS_PY_VENV):
  openai_client_test.py --setup   creates the venv NUCLEUS_PY_VENV and installs `openai`, `jinja2`
                                  (the reference renderer of chat templates) and `jsonschema`
                                  (the validator of structured outputs) into it
  openai_client_test.py           runs the tests (with the venv's interpreter when `openai`
                                  is not importable here; sets the venv up first if needed)
"""
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.request

VENV = os.environ.get("NUCLEUS_PY_VENV", os.path.join(tempfile.gettempdir(), "nucleus-openai-venv"))
VENV_PYTHON = os.path.join(VENV, "bin", "python")


def have_openai(python):
    return subprocess.run([python, "-c", "import openai, jinja2, jsonschema"], capture_output=True).returncode == 0


def setup_venv():
    if os.path.exists(VENV_PYTHON) and have_openai(VENV_PYTHON):
        return 0
    subprocess.run([sys.executable, "-m", "venv", VENV], check=True)
    r = subprocess.run([VENV_PYTHON, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "openai", "jinja2", "jsonschema"])
    return r.returncode


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`nucleus serve` on a free loopback port, logging to a temporary file."""

    def __init__(self, model=None, extra_args=()):
        self.port = free_port()
        self.log = tempfile.NamedTemporaryFile(prefix="nucleus_serve_", suffix=".log", delete=False)
        model = model or os.path.join(os.environ["NUCLEUS_MODELS_DIR"], "tiny-dsv3")
        self.proc = subprocess.Popen(
            [os.environ["NUCLEUS_BIN"], "serve", "--device", "cpu", "--model", model, "--port", str(self.port)]
            + list(extra_args),
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 30
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("server exited:\n" + self.output())
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("server did not become healthy:\n" + self.output())

    def post(self, path, body):
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())

    def output(self):
        with open(self.log.name, errors="replace") as f:
            return f.read()

    def terminate(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return None


class OpenAIClientTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        import openai
        cls.openai = openai
        cls.server = Server()
        cls.client = openai.OpenAI(base_url=f"http://127.0.0.1:{cls.server.port}/v1", api_key="none",
                                   max_retries=0, timeout=60)
        with open(os.path.join(os.environ["NUCLEUS_MODELS_DIR"], "ref", "cases.json")) as f:
            cls.cases = json.load(f)["tiny-dsv3"]

    @classmethod
    def tearDownClass(cls):
        cls.client.close()  # an idle keep-alive connection would hold the shutdown up to 5 s
        status = cls.server.terminate()
        assert status == 0, f"server exit status {status}:\n{cls.server.output()}"

    def test_models(self):
        models = self.client.models.list()
        self.assertEqual([m.id for m in models.data], ["tiny-dsv3"])

    def test_completion_matches_reference(self):
        case = self.cases[0]
        r = self.client.completions.create(model="tiny-dsv3", prompt=case["prompt"], max_tokens=32, temperature=0,
                                           extra_body={"ignore_eos": True})
        self.assertEqual(r.object, "text_completion")
        self.assertEqual(r.choices[0].text, case["greedy_text"])
        self.assertEqual(r.choices[0].finish_reason, "length")
        self.assertEqual(r.usage.prompt_tokens, len(case["prompt_token_ids"]))
        self.assertEqual(r.usage.completion_tokens, 32)
        self.assertEqual(r.usage.total_tokens, len(case["prompt_token_ids"]) + 32)

    def test_completion_stream(self):
        case = self.cases[6]
        chunks = list(self.client.completions.create(
            model="tiny-dsv3", prompt=case["prompt_token_ids"], max_tokens=32, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        self.assertEqual(text, case["greedy_text"])
        self.assertEqual(finishes, ["length"])
        self.assertEqual(chunks[-1].usage.completion_tokens, 32)

    def test_completion_n_and_seed(self):
        kw = dict(model="tiny-dsv3", prompt="import os\n", max_tokens=8, temperature=0.9, seed=11, n=2,
                  extra_body={"ignore_eos": True})
        whole = self.client.completions.create(**kw)
        self.assertEqual(len(whole.choices), 2)
        streamed = {0: "", 1: ""}
        for c in self.client.completions.create(stream=True, **kw):
            for ch in c.choices:
                streamed[ch.index] += ch.text
        self.assertEqual([c.text for c in whole.choices], [streamed[0], streamed[1]])

    def test_completion_echo_logprobs(self):
        # lm-eval's loglikelihood request (echo, logprobs 1, max_tokens 1), max_tokens 0, and
        # vLLM's prompt_logprobs; offsets in characters (Python's len of each token).
        case = self.cases[0]
        ids = case["prompt_token_ids"]
        r = self.client.completions.create(model="tiny-dsv3", prompt=ids, echo=True, logprobs=1, max_tokens=1,
                                           temperature=0)
        lp = r.choices[0].logprobs
        self.assertEqual(len(lp.tokens), len(ids) + 1)
        self.assertIsNone(lp.token_logprobs[0])
        self.assertTrue(all(x <= 0 for x in lp.token_logprobs[1:]))
        self.assertEqual(r.choices[0].text[:len(case["prompt"])], case["prompt"])
        only = self.client.completions.create(model="tiny-dsv3", prompt=ids, echo=True, logprobs=1, max_tokens=0,
                                              extra_body={"prompt_logprobs": 0})
        self.assertEqual(only.choices[0].logprobs.token_logprobs, lp.token_logprobs[:-1])
        self.assertEqual(only.choices[0].text, case["prompt"])
        self.assertEqual(only.usage.completion_tokens, 0)
        plp = only.choices[0].model_extra["prompt_logprobs"]
        self.assertEqual([None] + [plp[i][str(ids[i])]["logprob"] for i in range(1, len(ids))], lp.token_logprobs[:-1])
        text = "Zürich 日本 😀"
        g = self.client.completions.create(model="tiny-dsv3", prompt=text, echo=True, logprobs=0, max_tokens=0)
        glp = g.choices[0].logprobs
        offset = 0  # the BOS (special, skipped) takes no room
        for i, tok in enumerate(glp.tokens):
            self.assertEqual(glp.text_offset[i], offset)
            if i > 0:
                offset += len(tok.encode("utf-8", "surrogatepass").decode("utf-8", "replace"))
        # A character split across tokens counts once per piece (each piece is a U+FFFD), as in vLLM;
        # ASCII text adds up to the text.
        self.assertGreaterEqual(offset, len(text))
        self.assertEqual(lp.text_offset[-1], len(case["prompt"]))

    def test_chat(self):
        messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def f(x):"}]
        r = self.client.chat.completions.create(model="tiny-dsv3", messages=messages, max_tokens=10, temperature=0)
        self.assertEqual(r.object, "chat.completion")
        msg = r.choices[0].message
        self.assertEqual(msg.role, "assistant")
        self.assertIsInstance(msg.content, str)
        self.assertIn(r.choices[0].finish_reason, ("stop", "length"))
        self.assertEqual(r.usage.total_tokens, r.usage.prompt_tokens + r.usage.completion_tokens)
        stream = self.client.chat.completions.create(model="tiny-dsv3", messages=messages, max_tokens=10,
                                                     temperature=0, stream=True)
        roles, text, finishes = [], "", []
        for c in stream:
            for ch in c.choices:
                if ch.delta.role:
                    roles.append(ch.delta.role)
                text += ch.delta.content or ""
                if ch.finish_reason:
                    finishes.append(ch.finish_reason)
        self.assertEqual(roles, ["assistant"])
        self.assertEqual(text, msg.content)
        self.assertEqual(finishes, [r.choices[0].finish_reason])

    # Structured output. The tiny model's weights are random: at temperature 1
    # it fills JSON with whitespace wherever the grammar allows some, so the
    # budgets are large; the seeds are fixed (CPU sampling is deterministic).
    SCHEMA = {"type": "object",
              "properties": {"name": {"type": "string", "maxLength": 10},
                             "age": {"type": "integer", "minimum": 0, "maximum": 120},
                             "ok": {"type": "boolean"}},
              "required": ["name", "age", "ok"], "additionalProperties": False}
    MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]

    def setUp(self):
        if self._testMethodName.startswith(("test_response_format", "test_structured")) and not self.structured():
            self.skipTest("the server has no structured output (built with -DNUCLEUS_XGRAMMAR=OFF)")

    def structured(self):
        try:
            self.client.completions.create(model="tiny-dsv3", prompt="x", max_tokens=1,
                                           extra_body={"response_format": {"type": "json_object"}})
            return True
        except self.openai.BadRequestError as e:
            return "NUCLEUS_XGRAMMAR=OFF" not in str(e.body)

    def check_json(self, choices, text_of, schema=None):
        import jsonschema
        for c in choices:
            text = text_of(c)
            self.assertEqual(c.finish_reason, "stop", text)
            value = json.loads(text)
            self.assertIsInstance(value, dict, text)
            if schema:
                jsonschema.validate(value, schema)

    def test_response_format_json_schema(self):
        rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": self.SCHEMA, "strict": True}}
        r = self.client.chat.completions.create(model="tiny-dsv3", messages=self.MESSAGES, response_format=rf,
                                                temperature=1, seed=1, n=4, max_tokens=900)
        self.assertEqual(len(r.choices), 4)
        self.check_json(r.choices, lambda c: c.message.content, self.SCHEMA)
        r = self.client.completions.create(model="tiny-dsv3", prompt="JSON:", temperature=1, seed=2, n=3,
                                           max_tokens=900, extra_body={"response_format": rf})
        self.check_json(r.choices, lambda c: c.text, self.SCHEMA)
        # Keys come in the schema's order, as the client wrote it (not sorted).
        for c in r.choices:
            value = json.loads(c.text)
            self.assertEqual(list(value)[:2], ["name", "age"], c.text)

    def test_response_format_json_object(self):
        r = self.client.chat.completions.create(model="tiny-dsv3", messages=self.MESSAGES,
                                                response_format={"type": "json_object"}, temperature=1, seed=11, n=4,
                                                max_tokens=900)
        self.check_json(r.choices, lambda c: c.message.content)

    def test_response_format_stream(self):
        kw = dict(model="tiny-dsv3", messages=self.MESSAGES, temperature=1, seed=7, n=2, max_tokens=900,
                  response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": self.SCHEMA}})
        whole = self.client.chat.completions.create(**kw)
        self.check_json(whole.choices, lambda c: c.message.content, self.SCHEMA)
        text, finishes = {0: "", 1: ""}, {}
        for chunk in self.client.chat.completions.create(stream=True, **kw):
            for ch in chunk.choices:
                text[ch.index] += ch.delta.content or ""
                if ch.finish_reason:
                    finishes[ch.index] = ch.finish_reason
        self.assertEqual(text, {c.index: c.message.content for c in whole.choices})
        self.assertEqual(finishes, {0: "stop", 1: "stop"})

    def test_response_format_pydantic_parse(self):
        # The client's own structured-output helper: a pydantic model becomes a
        # strict json_schema, and the reply is parsed back into it.
        import pydantic
        from typing import Literal

        class Pet(pydantic.BaseModel):
            kind: Literal["cat", "dog"]
            legs: int = pydantic.Field(ge=0, le=8)
            vaccinated: bool

        parse = getattr(self.client.chat.completions, "parse", None) or self.client.beta.chat.completions.parse
        r = parse(model="tiny-dsv3", messages=self.MESSAGES, response_format=Pet, temperature=1, seed=3, n=3,
                  max_tokens=900)
        for c in r.choices:
            self.assertEqual(c.finish_reason, "stop", c.message.content)
            self.assertIsInstance(c.message.parsed, Pet, c.message.content)

    def test_structured_outputs_extra_body(self):
        # vLLM's parameters, through extra_body: compact JSON, a regex, a choice.
        r = self.client.completions.create(
            model="tiny-dsv3", prompt="JSON:", temperature=1, seed=9, n=3, max_tokens=200,
            extra_body={"structured_outputs": {"json": self.SCHEMA, "disable_any_whitespace": True}})
        self.check_json(r.choices, lambda c: c.text, self.SCHEMA)
        r = self.client.completions.create(model="tiny-dsv3", prompt="x", temperature=1, seed=1, max_tokens=20,
                                           extra_body={"guided_choice": ["alpha", "beta"]})
        self.assertIn(r.choices[0].text, ("alpha", "beta"))
        r = self.client.completions.create(model="tiny-dsv3", prompt="x", temperature=1, seed=1, max_tokens=20,
                                           extra_body={"structured_outputs": {"regex": "[a-c]{2}[0-9]"}})
        self.assertRegex(r.choices[0].text, r"^[a-c]{2}[0-9]$")

    def test_response_format_errors(self):
        bad = [({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}, "nonsense"),
               ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 3,
                                                                                   "maximum": 1}}}, ""),
               ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema"),
               ({"type": "xml"}, "xml")]
        for rf, words in bad:
            with self.assertRaises(self.openai.BadRequestError) as e:
                self.client.chat.completions.create(model="tiny-dsv3", messages=self.MESSAGES, response_format=rf,
                                                    max_tokens=4)
            self.assertEqual(e.exception.status_code, 400)
            self.assertEqual(e.exception.body.get("param"), "response_format", e.exception.body)
            self.assertIn(words, e.exception.body.get("message"))
        r = self.client.chat.completions.create(model="tiny-dsv3", messages=self.MESSAGES, max_tokens=4,
                                                response_format={"type": "text"})
        self.assertEqual(len(r.choices), 1)

    def test_errors(self):
        with self.assertRaises(self.openai.BadRequestError) as e:
            self.client.completions.create(model="tiny-dsv3", prompt="x", temperature=-1)
        self.assertEqual(e.exception.status_code, 400)
        self.assertEqual(e.exception.body.get("param"), "temperature")
        with self.assertRaises(self.openai.NotFoundError):
            self.client.completions.create(model="no-such-model", prompt="x")
        with self.assertRaises(self.openai.BadRequestError):
            self.client.chat.completions.create(model="tiny-dsv3", messages=[], max_tokens=4)

    def detokenize(self, ids):
        req = urllib.request.Request(f"http://127.0.0.1:{self.server.port}/detokenize",
                                     data=json.dumps({"tokens": ids}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())["prompt"]

    def test_sampling_parameters_are_honoured(self):
        # vLLM's semantics; OpenAI's own parameters (presence_penalty, frequency_penalty, logit_bias) as
        # the client's arguments, vLLM's extensions (repetition_penalty, min_tokens, min_p) in extra_body.
        case = self.cases[0]
        base = dict(model="tiny-dsv3", prompt=case["prompt"], max_tokens=32, temperature=0)
        ignore_eos = {"ignore_eos": True}
        # logit_bias +100 forces a token, greedy and sampled, completions and chat.
        forced = self.detokenize([42] * 8)
        r = self.client.completions.create(**dict(base, max_tokens=8), logit_bias={"42": 100}, extra_body=ignore_eos)
        self.assertEqual(r.choices[0].text, forced)
        r = self.client.completions.create(**dict(base, max_tokens=8, temperature=1.0), seed=5,
                                           logit_bias={"42": 100}, extra_body=ignore_eos)
        self.assertEqual(r.choices[0].text, forced)
        c = self.client.chat.completions.create(model="tiny-dsv3", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=8, temperature=0, logit_bias={"42": 100},
                                                extra_body=ignore_eos)
        self.assertEqual(c.choices[0].message.content, forced)
        # Penalties change the greedy continuation; neutral values leave it alone.
        r = self.client.completions.create(**base, presence_penalty=0, frequency_penalty=0,
                                           extra_body={"ignore_eos": True, "repetition_penalty": 1, "min_p": 0})
        self.assertEqual(r.choices[0].text, case["greedy_text"])
        for kw in (dict(presence_penalty=2.0), dict(frequency_penalty=2.0),
                   dict(extra_body={"ignore_eos": True, "repetition_penalty": 3.0})):
            kw.setdefault("extra_body", ignore_eos)
            r = self.client.completions.create(**base, **kw)
            self.assertNotEqual(r.choices[0].text, case["greedy_text"], kw)
            self.assertEqual(r.usage.completion_tokens, 32)
        # min_tokens holds EOS (id 1, biased to come first) back; the stream agrees.
        eos_first = dict(base, max_tokens=16, logit_bias={"1": 100})
        r = self.client.completions.create(**eos_first)
        self.assertEqual((r.usage.completion_tokens, r.choices[0].finish_reason), (1, "stop"))
        r = self.client.completions.create(**eos_first, extra_body={"min_tokens": 4})
        self.assertEqual((r.usage.completion_tokens, r.choices[0].finish_reason), (5, "stop"))
        chunks = list(self.client.completions.create(**eos_first, stream=True, extra_body={"min_tokens": 4}))
        self.assertEqual("".join(ch.choices[0].text for ch in chunks if ch.choices), r.choices[0].text)
        # min_p 1 keeps only the most likely token: sampling equals greedy.
        r = self.client.completions.create(**dict(base, temperature=1.5), seed=9,
                                           extra_body={"ignore_eos": True, "min_p": 1.0})
        self.assertEqual(r.choices[0].text, case["greedy_text"])

    def test_sampling_parameter_errors_name_the_parameter(self):
        cases = [
            (dict(presence_penalty=2.5), "presence_penalty"),
            (dict(frequency_penalty=-3), "frequency_penalty"),
            (dict(logit_bias={"99999": 1}), "logit_bias"),
            (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty"),
            (dict(extra_body={"min_p": 2}), "min_p"),
            (dict(extra_body={"min_tokens": 9}), "min_tokens"),
        ]
        for kw, param in cases:
            with self.assertRaises(self.openai.BadRequestError, msg=param) as e:
                self.client.completions.create(model="tiny-dsv3", prompt="x", max_tokens=8, **kw)
            self.assertEqual(e.exception.status_code, 400)
            self.assertEqual(e.exception.body.get("param"), param)
            if param == "logit_bias":
                self.assertIn("99999", e.exception.body.get("message"))
        with self.assertRaises(self.openai.BadRequestError) as e:
            self.client.chat.completions.create(model="tiny-dsv3", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=4, extra_body={"min_tokens": 5})
        self.assertEqual(e.exception.body.get("param"), "min_tokens")


# A template that prints `tools | tojson` the way the Kimi-K2 and DeepSeek-V3.2 templates do.
TOOLS_TEMPLATE = ("{% if tools %}<tools>{{ tools | tojson }}</tools>\n{% endif %}"
                  "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                  "{% if flag %}{{ flag | tojson }}{% endif %}")


class ChatTemplateToolsTest(unittest.TestCase):
    """Chat templates see the request's objects with their keys in the client's order: the
    rendered prompt equals Python jinja2 with transformers' tojson (json.dumps, keys unsorted)."""

    @classmethod
    def setUpClass(cls):
        src = os.path.join(os.environ["NUCLEUS_MODELS_DIR"], "tiny-dsv3")
        cls.dir = tempfile.mkdtemp(prefix="nucleus_tools_model_")
        for name in os.listdir(src):
            if name != "tokenizer_config.json":
                os.symlink(os.path.join(src, name), os.path.join(cls.dir, name))
        with open(os.path.join(src, "tokenizer_config.json")) as f:
            config = json.load(f)
        config["chat_template"] = TOOLS_TEMPLATE
        with open(os.path.join(cls.dir, "tokenizer_config.json"), "w") as f:
            json.dump(config, f)
        cls.server = Server(cls.dir)

    @classmethod
    def tearDownClass(cls):
        cls.server.terminate()

    def post(self, path, body):
        req = urllib.request.Request(f"http://127.0.0.1:{self.server.port}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())

    def test_tools_tojson_keeps_the_clients_key_order(self):
        import jinja2
        tools = [{"type": "function", "function": {
            "name": "get_weather", "description": "Weather — for a city (°C)",
            "parameters": {"type": "object", "required": ["zip", "city"],
                           "properties": {"zip": {"type": "string"}, "city": {"type": "string"}}}}}]
        messages = [{"role": "user", "content": "Weather in Zürich?"}]
        kwargs = {"flag": {"z": 1, "a": [2, {"y": None, "b": True}]}}
        env = jinja2.Environment()
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        expected = env.from_string(TOOLS_TEMPLATE).render(tools=tools, messages=messages, add_generation_prompt=True,
                                                         **kwargs)
        self.assertIn('{"type": "function", "function": {"name"', expected)
        ids = self.post("/tokenize", {"messages": messages, "tools": tools, "chat_template_kwargs": kwargs})["tokens"]
        text = self.post("/detokenize", {"tokens": ids})["prompt"]
        self.assertEqual(text, expected)


# What the edited tokenizer makes the tiny model's greedy tokens after the prompt read as: R1
# reasoning, content, then one DeepSeek-V3 tool call, with markers split across tokens (a partial
# marker at a chunk boundary) and two markers as special tokens (kept for the parser although
# skip_special_tokens is on). The prompt is the first of TOOL_PROMPTS for which the edit works.
TOOL_PROMPTS = ["Hello", "return", "The"]
TOOL_TOKENS = ["Need the weather.", "</thi", "nk>Checking.", "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>",
               "function<｜tool▁sep｜>get_weather\n```json\n", '{"city": "Pa', 'ris"}\n``', "`<｜tool▁call▁e",
               "nd｜><｜tool▁calls▁end｜>"]
SPECIAL_TOOL_TOKENS = (3, 4)
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def edited_tokenizer_model(greedy):
    """A copy of tiny-dsv3 (weights linked) whose tokenizer reads greedy[i] as TOOL_TOKENS[i]: each
    such id loses its vocab entry (and the merges that name it) and becomes an added token with
    that text. When the prompt still encodes as before (the caller checks), the model's output
    ids do not change: only what they read as."""
    src = os.path.join(os.environ["NUCLEUS_MODELS_DIR"], "tiny-dsv3")
    out = tempfile.mkdtemp(prefix="nucleus_tool_model_")
    for name in os.listdir(src):
        if name not in ("tokenizer.json", "tokenizer_config.json"):
            os.symlink(os.path.join(src, name), os.path.join(out, name))
    with open(os.path.join(src, "tokenizer.json")) as f:
        tok = json.load(f)
    ids = greedy[:len(TOOL_TOKENS)]
    strings = {i: s for s, i in tok["model"]["vocab"].items() if i in ids}
    removed = set(strings.values())
    tok["model"]["vocab"] = {s: i for s, i in tok["model"]["vocab"].items() if s not in removed}

    def keep(m):
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        return a not in removed and b not in removed and a + b not in removed
    tok["model"]["merges"] = [m for m in tok["model"]["merges"] if keep(m)]
    for k, i in enumerate(ids):
        tok["added_tokens"].append({"id": i, "content": TOOL_TOKENS[k], "single_word": False, "lstrip": False,
                                    "rstrip": False, "normalized": False, "special": k in SPECIAL_TOOL_TOKENS})
    with open(os.path.join(out, "tokenizer.json"), "w") as f:
        json.dump(tok, f, ensure_ascii=False)
    with open(os.path.join(src, "tokenizer_config.json")) as f:
        config = json.load(f)
    config["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    return out


class ToolCallsAndReasoningTest(unittest.TestCase):
    """--tool-call-parser deepseek_v3 --enable-auto-tool-choice --reasoning-parser deepseek_r1
    through the official client, on a deterministic output: the tiny model writes no markers,
    so its tokenizer is edited to read its greedy tokens after a prompt as TOOL_TOKENS."""

    @classmethod
    def setUpClass(cls):
        import openai
        plain, ids_only = Server(), Server(extra_args=["--skip-tokenizer-init"])
        cls.server, tried = None, []
        try:
            for prompt in TOOL_PROMPTS:
                prompt_ids = plain.post("/tokenize", {"prompt": prompt, "add_special_tokens": False})["tokens"]
                greedy = ids_only.post("/v1/completions", {"prompt": prompt_ids, "max_tokens": len(TOOL_TOKENS) + 1,
                                                          "temperature": 0, "ignore_eos": True})["choices"][0]["token_ids"]
                tried.append((prompt, prompt_ids, greedy))
                # Distinct ordinary tokens, none in the prompt; the last one stops the output.
                if len(set(greedy)) < len(greedy) or set(greedy) & set(prompt_ids) or min(greedy) < 3:
                    continue
                model = edited_tokenizer_model(greedy)
                server = Server(model, ["--tool-call-parser", "deepseek_v3", "--enable-auto-tool-choice",
                                        "--reasoning-parser", "deepseek_r1"])
                if server.post("/tokenize", {"prompt": prompt, "add_special_tokens": False})["tokens"] == prompt_ids:
                    cls.server, cls.dir, cls.prompt, cls.stop_id = server, model, prompt, greedy[-1]
                    break
                server.terminate()
        finally:
            plain.terminate()
            ids_only.terminate()
        assert cls.server, f"no prompt of TOOL_PROMPTS suits the tokenizer edit: {tried}"
        cls.openai = openai
        cls.client = openai.OpenAI(base_url=f"http://127.0.0.1:{cls.server.port}/v1", api_key="none",
                                   max_retries=0, timeout=60)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.server.terminate()

    def create(self, **kw):
        args = dict(model=self.dir, messages=[{"role": "user", "content": self.prompt}], temperature=0, max_tokens=32,
                    extra_body={"stop_token_ids": [self.stop_id]})
        args.update(kw)
        return self.client.chat.completions.create(**args)

    def test_tool_call(self):
        r = self.create(tools=TOOLS)
        choice = r.choices[0]
        self.assertEqual(choice.finish_reason, "tool_calls")
        msg = choice.message
        self.assertEqual(msg.content, "Checking.")
        self.assertEqual(msg.model_extra.get("reasoning_content"), "Need the weather.")
        self.assertEqual(msg.model_extra.get("reasoning"), "Need the weather.")
        self.assertEqual(len(msg.tool_calls), 1)
        call = msg.tool_calls[0]
        self.assertEqual(call.type, "function")
        self.assertTrue(call.id.startswith("chatcmpl-tool-"), call.id)
        self.assertEqual(call.function.name, "get_weather")
        self.assertEqual(call.function.arguments, '{"city": "Paris"}')
        self.assertEqual(json.loads(call.function.arguments), {"city": "Paris"})

    def test_tool_call_streamed_equals_whole(self):
        whole = self.create(tools=TOOLS, n=2)
        stream = self.create(tools=TOOLS, n=2, stream=True)
        got = {i: {"reasoning": "", "content": "", "calls": [], "finish": []} for i in (0, 1)}
        for chunk in stream:
            for ch in chunk.choices:
                g = got[ch.index]
                extra = ch.delta.model_extra or {}
                self.assertEqual(extra.get("reasoning_content"), extra.get("reasoning"))
                g["reasoning"] += extra.get("reasoning_content") or ""
                if ch.delta.content:
                    self.assertEqual(g["calls"], [], "content after a tool call")
                    g["content"] += ch.delta.content
                for t in ch.delta.tool_calls or []:
                    if t.id is not None:  # a call's first delta: index, id, type, name
                        self.assertEqual(t.index, len(g["calls"]))
                        self.assertEqual(t.type, "function")
                        g["calls"].append({"id": t.id, "name": t.function.name, "arguments": ""})
                    else:  # then argument pieces only
                        self.assertIsNone(t.function.name)
                        self.assertEqual(t.index, len(g["calls"]) - 1)
                        g["calls"][t.index]["arguments"] += t.function.arguments
                if ch.finish_reason:
                    g["finish"].append(ch.finish_reason)
        for c in whole.choices:
            g = got[c.index]
            self.assertEqual(g["finish"], [c.finish_reason])
            self.assertEqual(g["reasoning"], c.message.model_extra["reasoning_content"])
            self.assertEqual(g["content"], c.message.content)
            self.assertEqual([(x["name"], x["arguments"]) for x in g["calls"]],
                             [(t.function.name, t.function.arguments) for t in c.message.tool_calls])

    def test_cut_off_by_max_tokens_or_a_stop_string(self):
        # 8 tokens end with 'ris"}\n``': the call so far, without the partial fence.
        r = self.create(tools=TOOLS, max_tokens=8)
        self.assertEqual(r.choices[0].finish_reason, "length")
        self.assertEqual(r.choices[0].message.tool_calls[0].function.arguments, '{"city": "Paris"}')
        # 2 tokens end inside "</think>": reasoning only, the partial marker is reasoning text.
        r = self.create(tools=TOOLS, max_tokens=2)
        self.assertEqual(r.choices[0].message.model_extra["reasoning_content"], "Need the weather.</thi")
        self.assertIsNone(r.choices[0].message.content)
        # A stop string in the content: no calls, finish_reason "stop"; streamed alike.
        for stream in (False, True):
            r = self.create(tools=TOOLS, stop=["king."], stream=stream)
            if stream:
                chunks = [c.choices[0] for c in r if c.choices]
                content = "".join(c.delta.content or "" for c in chunks)
                self.assertFalse(any(c.delta.tool_calls for c in chunks))
                self.assertEqual([c.finish_reason for c in chunks if c.finish_reason], ["stop"])
                self.assertEqual(content, "Chec")
            else:
                self.assertEqual(r.choices[0].finish_reason, "stop")
                self.assertEqual(r.choices[0].message.content, "Chec")
                self.assertIsNone(r.choices[0].message.tool_calls)

    def test_not_parsed_without_tools_or_with_tool_choice_none(self):
        for kw in ({}, {"tools": TOOLS, "tool_choice": "none"}):
            msg = self.create(max_tokens=len(TOOL_TOKENS), **kw).choices[0].message
            self.assertIsNone(msg.tool_calls)
            # The special marker tokens are skipped (skip_special_tokens), the rest is text.
            self.assertEqual(msg.content, "Checking.function<｜tool▁sep｜>get_weather\n```json\n"
                                          '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
        msg = self.create(max_tokens=len(TOOL_TOKENS), extra_body={"skip_special_tokens": False}).choices[0].message
        self.assertEqual(msg.content, "".join(TOOL_TOKENS[2:])[len("nk>"):])

    def test_refusals(self):
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            with self.assertRaises(self.openai.BadRequestError) as e:
                self.create(tools=TOOLS, tool_choice=choice)
            self.assertEqual(e.exception.body.get("param"), "tool_choice")


def main():
    if "--setup" in sys.argv:
        return setup_venv()
    try:
        import jinja2  # noqa: F401
        import jsonschema  # noqa: F401
        import openai  # noqa: F401
    except ImportError:
        if os.path.realpath(sys.prefix) != os.path.realpath(VENV):  # not yet running in the venv
            if setup_venv() != 0:
                print("could not install the openai package", file=sys.stderr)
                return 1
            return subprocess.run([VENV_PYTHON, os.path.abspath(__file__)] + sys.argv[1:]).returncode
        raise
    result = unittest.main(exit=False, verbosity=2).result
    print(f"{result.testsRun - len(result.failures) - len(result.errors)} passed, "
          f"{len(result.failures) + len(result.errors)} failed")
    return 0 if result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main())
