"""kiln llm serve with the official `openai` client on 127.0.0.1: every endpoint, streaming (SSE
ending in [DONE], a usage chunk with include_usage), answers equal to the offline engine's,
errors as OpenAI's, cancellation freeing blocks, metrics. The server stops by itself (max_lifetime)."""

import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")

from kiln.llm import LLM, SamplingParams  # noqa: E402
from kiln.llm.config import EngineConfig  # noqa: E402
from kiln.llm.server import LLMServer, ServerOptions  # noqa: E402

ENGINE = dict(kv_cache_memory="4MiB", block_size=4)
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello kiln!"}]


@pytest.fixture(scope="module")
def folder(hf_models):
    return hf_models("llama")[0]


@pytest.fixture(scope="module")
def server(folder):
    server = LLMServer(ServerOptions(folder, served_model_name="tiny-llama", port=0, engine=EngineConfig(**ENGINE),
                                     max_lifetime=600)).start_in_thread()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline(folder):
    return LLM(folder, **ENGINE)


def post(server, path, body, raw=False):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(server.url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            payload = response.read().decode()
            return response.status, payload if raw else json.loads(payload)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode())


def test_models_and_health(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny-llama"]
    assert models[0].owned_by == "kiln"
    with urllib.request.urlopen(server.url + "/health", timeout=30) as response:
        assert response.status == 200


def test_completion_equals_the_offline_engine(client, offline):
    expected = offline.generate(["Hello world"], SamplingParams(max_tokens=12, temperature=0, logprobs=2))[0]
    r = client.completions.create(model="tiny-llama", prompt="Hello world", max_tokens=12, temperature=0, logprobs=2)
    choice = r.choices[0]
    assert choice.text == expected.outputs[0].text and choice.finish_reason == "length"
    assert choice.logprobs.token_logprobs == pytest.approx([t.logprob for t in expected.outputs[0].logprobs], abs=1e-5)
    # top_logprobs maps token text -> logprob: two tokens that are both part of one character show as the same
    # text (U+FFFD) and share an entry, as in OpenAI's format
    assert all(1 <= len(top) <= 2 for top in choice.logprobs.top_logprobs)
    assert choice.logprobs.tokens[0] in choice.logprobs.top_logprobs[0]
    assert r.usage.prompt_tokens == len(expected.prompt_token_ids) and r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12 and r.object == "text_completion"


def test_several_prompts_n_and_token_prompts(client, offline):
    prompts = ["The quick brown fox", "Paged attention"]
    r = client.completions.create(model="tiny-llama", prompt=prompts, max_tokens=6, n=2, temperature=0.8, seed=5)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    expected = offline.generate(prompts, SamplingParams(max_tokens=6, n=2, temperature=0.8, seed=5))
    assert [c.text for c in r.choices] == [c.text for o in expected for c in o.outputs]
    ids = offline.tokenizer.encode("The quick brown fox")
    r2 = client.completions.create(model="tiny-llama", prompt=ids, max_tokens=6, temperature=0)
    r3 = client.completions.create(model="tiny-llama", prompt="The quick brown fox", max_tokens=6, temperature=0,
                                   echo=True)
    assert r3.choices[0].text == "The quick brown fox" + r2.choices[0].text


def test_streaming_completion_adds_up_and_ends_with_done_and_usage(server, client):
    whole = client.completions.create(model="tiny-llama", prompt="Hello world", max_tokens=16, temperature=0)
    chunks = list(client.completions.create(model="tiny-llama", prompt="Hello world", max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    status, raw = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 3, "stream": True}, raw=True)
    assert status == 200 and raw.endswith("data: [DONE]\n\n")
    assert all(line.startswith("data: ") for line in raw.strip().split("\n\n"))
    assert '"usage"' not in raw  # no usage fields without include_usage


def test_chat_equals_offline_chat_template(client, offline):
    expected = offline.chat(CHAT, SamplingParams(max_tokens=10, temperature=0))[0]
    r = client.chat.completions.create(model="tiny-llama", messages=CHAT, max_tokens=10, temperature=0,
                                       logprobs=True, top_logprobs=3)
    message = r.choices[0].message
    assert message.role == "assistant" and message.content == expected.outputs[0].text
    assert r.usage.prompt_tokens == len(offline.tokenizer.encode_chat(CHAT)) and r.object == "chat.completion"
    content = r.choices[0].logprobs.content
    assert len(content) == 10 and all(len(t.top_logprobs) == 3 for t in content)
    chunks = list(client.chat.completions.create(model="tiny-llama", messages=CHAT, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == message.content
    assert chunks[-1].usage.total_tokens == r.usage.total_tokens
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_stop_strings_and_extras(client, offline):
    full = client.completions.create(model="tiny-llama", prompt="Hello world", max_tokens=16, temperature=0)
    stop = full.choices[0].text[4:6]
    r = client.completions.create(model="tiny-llama", prompt="Hello world", max_tokens=16, temperature=0, stop=[stop])
    assert r.choices[0].text == full.choices[0].text[:full.choices[0].text.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    r = client.completions.create(model="tiny-llama", prompt="Hello world", max_tokens=8, temperature=1.0,
                                  extra_body={"top_k": 1, "ignore_eos": True, "min_tokens": 8})
    assert r.choices[0].text == client.completions.create(model="tiny-llama", prompt="Hello world", max_tokens=8,
                                                          temperature=0).choices[0].text


def test_errors_are_openai_errors(server, client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4", prompt="x")
    with pytest.raises(openai.BadRequestError, match="maximum context length is 256"):
        client.completions.create(model="tiny-llama", prompt="word " * 300)
    with pytest.raises(openai.BadRequestError, match="lower max_tokens"):
        client.completions.create(model="tiny-llama", prompt="x", max_tokens=1000)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="tiny-llama", prompt="x", temperature=-1)
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(model="tiny-llama", prompt="x", logit_bias={"5": 1.0})
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model="tiny-llama", messages=[])
    status, body = post(server, "/v1/completions", b"{not json")
    assert status == 400 and "error" in body
    status, body = post(server, "/v1/completions", {"prompt": [5, 10**9]})
    assert status == 400 and "outside the vocabulary" in body["error"]["message"]


def test_tokenize_detokenize(server, offline):
    status, body = post(server, "/tokenize", {"prompt": "Hello kiln"})
    assert status == 200 and body["tokens"] == offline.tokenizer.encode("Hello kiln") and body["count"] == len(
        body["tokens"]) and body["max_model_len"] == 256
    status, chat = post(server, "/tokenize", {"messages": CHAT})
    assert chat["tokens"] == offline.tokenizer.encode_chat(CHAT)
    status, back = post(server, "/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and back["prompt"] == "<|bos|>Hello kiln"


def test_disconnecting_a_stream_cancels_it_and_frees_blocks(server, client):
    engine = server.llm.engine
    stream = client.completions.create(model="tiny-llama", prompt="Hello world", max_tokens=200, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()
    deadline = time.monotonic() + 60
    while engine.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks - 1
    assert engine.stats.finished.get("abort", 0) >= 1


def test_concurrent_clients_get_what_they_would_get_alone(client, offline):
    prompts = ["Hello world", "The quick brown fox", "Paged attention reads", "Ü", "In-flight batching", "a b c"]
    expected = [o.outputs[0].text for o in offline.generate(prompts, SamplingParams(max_tokens=10, temperature=0))]
    results = [None] * len(prompts)

    def ask(i):
        results[i] = client.completions.create(model="tiny-llama", prompt=prompts[i], max_tokens=10,
                                               temperature=0).choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == expected


def test_metrics(server, client):
    client.completions.create(model="tiny-llama", prompt="metrics please", max_tokens=4, temperature=0)
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    for name in ("kiln:num_requests_running", "kiln:num_requests_waiting", "kiln:kv_cache_usage_perc",
                 "kiln:prefix_cache_queries_total", "kiln:prefix_cache_hits_total",
                 "kiln:time_to_first_token_seconds_bucket", "kiln:request_time_per_output_token_seconds_bucket",
                 "kiln:inter_token_latency_seconds_bucket", "kiln:e2e_request_latency_seconds_count"):
        assert name in text, name
    generated = [line for line in text.splitlines() if line.startswith("kiln:generation_tokens_total")]
    assert float(generated[0].split()[-1]) >= 4
    assert 'kiln:request_success_total{finished_reason="length",model_name="tiny-llama"}' in text


def test_kiln_llm_serve_command(folder):
    """The CLI verb: prints its address, answers, stops on SIGTERM; bounded by a timeout."""
    process = subprocess.Popen([sys.executable, "-m", "kiln", "llm", "serve", str(folder), "--port", "0",
                                "--kv-cache-memory", "2MiB", "--block-size", "8"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = None
        deadline = time.monotonic() + 120
        while url is None and time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line:
                break
            if "OpenAI API on" in line:
                url = line.split("OpenAI API on ")[1].strip().removesuffix("/v1")
        assert url, process.stderr.read()
        body = json.dumps({"prompt": "Hi", "max_tokens": 2}).encode()
        request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            assert json.load(response)["usage"]["completion_tokens"] == 2
        process.terminate()
        assert process.wait(timeout=60) == 0
        assert "stopped" in process.stdout.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
