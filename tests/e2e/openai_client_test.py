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

    def __init__(self, model=None):
        self.port = free_port()
        self.log = tempfile.NamedTemporaryFile(prefix="nucleus_serve_", suffix=".log", delete=False)
        model = model or os.path.join(os.environ["NUCLEUS_MODELS_DIR"], "tiny-dsv3")
        self.proc = subprocess.Popen(
            [os.environ["NUCLEUS_BIN"], "serve", "--device", "cpu", "--model", model, "--port", str(self.port)],
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
