"""Issue 30: OpenAI's completions API over a served language model (serving/rest/openai.py), stepped by the server's
decode loop (serving/generation/decoder.py), spoken to by the real `openai` client and by raw HTTP.

What holds on every CPU: the served text equals the model's own generate signature (greedy, and sampled with the
same seed, prompt by prompt); a stream is the same text in pieces; bounds are refused before any model work with
a 4xx naming the field; a client that leaves or runs out of time stops costing decode steps; concurrent requests
share decode steps."""

from __future__ import annotations

import http.client
import json
import threading
import time

import grpc
import keras
import numpy as np
import openai
import pytest
import tensorflow as tf

from pipeline.lm import causal_lm, generate
from serving.app import ServerThread, build
from serving.flags import parse
from serving.rest.openai import ChoiceText, Limits, OpenAIError, parse_completion
from serving.generation import decoder as decoder_module
from serving.generation.decoder import Token
from lm_helpers import grpc_generate
from server_helpers import logged_models_config

pytestmark = pytest.mark.timeout(300)
CONTEXT = 64


@pytest.fixture(scope="module")
def generator(tmp_path_factory):
    keras.config.set_dtype_policy("float32")
    keras.utils.set_random_seed(4)
    model = causal_lm.build_causal_lm(context_length=CONTEXT, num_layers=1, num_heads=2, width=16, mlp_width=32)
    base = tmp_path_factory.mktemp("lm") / "lm"
    generated = generate.Generator(model)
    save_with_pad(generated, base / "1")
    return generated, base


def save_with_pad(generated, path):
    """The SavedModel, and the one fact of pipeline.json a served generate needs: the id its ids are padded with."""
    generate.save(generated, path)
    (path / "assets.extra").mkdir(exist_ok=True)
    (path / "assets.extra" / "pipeline.json").write_text(json.dumps(
        {"language_model": {"tokenizer": {"special_ids": {"pad": causal_lm.PAD}}}}))


def long_model(tmp_path):
    """A model with a context of 1,024 that never ends its text (EOS's logit held down): a request for the whole
    context runs until it is given up."""
    keras.utils.set_random_seed(5)
    model = causal_lm.build_causal_lm(context_length=1024, num_layers=1, num_heads=2, width=16, mlp_width=32,
                                      tied_embeddings=False)
    model.get_layer("logits").bias.assign(-1e4 * tf.one_hot(causal_lm.EOS, causal_lm.VOCAB_SIZE))
    save_with_pad(generate.Generator(model), tmp_path / "lm" / "1")
    return tmp_path / "lm"


def start(base, *flags) -> ServerThread:
    options = parse(["--model_name=lm", f"--model_base_path={base}", "--port=0", "--rest_api_port=-1", *flags])
    return ServerThread(options, build(options))


@pytest.fixture(scope="module")
def server(generator):
    with start(generator[1], "--generation_max_new_tokens=48", "--generation_max_prompt_bytes=40") as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://{server.rest_address}/openai/v1", api_key="unused", max_retries=0)


def decoder_of(server):
    generations = server.server._core.generations
    (decoder,) = generations._decoders.values()
    return decoder


def idle(decoder, timeout_s: float = 20.0):
    """Waits until the decode loop has no rows (a cancelled row leaves before the next step); returns it."""
    deadline = time.monotonic() + timeout_s
    while decoder.rows and time.monotonic() < deadline:
        time.sleep(0.005)
    assert decoder.rows == 0
    return decoder


def in_process(generated, prompts, max_new_tokens, temperature=0.0, top_k=0, seed=0) -> dict[str, np.ndarray]:
    out = generated.generate(tf.constant(prompts), tf.constant(max_new_tokens), tf.constant(temperature, tf.float32),
                             tf.constant(top_k), tf.constant(seed, tf.int64))
    return {name: value.numpy() for name, value in out.items()}


def text_of(completion: bytes) -> str:
    return completion.decode("utf-8", errors="replace")


def test_the_models_that_can_generate_are_listed(client):
    assert [model.id for model in client.models.list()] == ["lm"]
    assert client.models.retrieve("lm").id == "lm"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")


def test_greedy_completions_equal_the_models_own_generate(generator, client):
    prompts = ["Once upon a time", "é"]
    answer = client.completions.create(model="lm", prompt=prompts, max_tokens=12, temperature=0)
    want = in_process(generator[0], prompts, 12)
    for choice in answer.choices:
        assert choice.text == text_of(want["completions"][choice.index])
        assert choice.finish_reason == ("stop" if want["lengths"][choice.index] < 12 else "length")
    assert answer.usage.prompt_tokens == len("Once upon a time") + 1 + len("é".encode()) + 1  # BOS each
    assert answer.usage.completion_tokens == int(want["lengths"].sum())
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens


def test_a_seed_gives_the_same_text_as_generate_prompt_by_prompt(generator, client):
    prompts = ["Once upon a time", "é", "x"]
    # top_k is not OpenAI's: the client passes it as vLLM's clients do, in extra_body
    answer = client.completions.create(model="lm", prompt=prompts, max_tokens=16, temperature=0.9, seed=7,
                                       extra_body={"top_k": 20})
    again = client.completions.create(model="lm", prompt=prompts, max_tokens=16, temperature=0.9, seed=7,
                                      extra_body={"top_k": 20})
    want = in_process(generator[0], prompts, 16, 0.9, 20, 7)
    assert [c.text for c in answer.choices] == [c.text for c in again.choices]
    assert [c.text for c in answer.choices] == [text_of(c) for c in want["completions"]]


def test_a_stream_is_the_same_text_in_pieces_ending_with_the_finish_reason_and_usage(client):
    whole = client.completions.create(model="lm", prompt=["Once upon a time", "é"], max_tokens=20, temperature=0)
    chunks = list(client.completions.create(model="lm", prompt=["Once upon a time", "é"], max_tokens=20,
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    texts, reasons = ["", ""], [None, None]
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        assert reasons[choice.index] is None  # nothing after a choice's finish_reason
        texts[choice.index] += choice.text
        reasons[choice.index] = choice.finish_reason
    assert texts == [c.text for c in whole.choices] and reasons == [c.finish_reason for c in whole.choices]
    assert len(chunks) > 4 and chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_raw_server_sent_events_end_with_done(server):
    connection = http.client.HTTPConnection(server.rest_address, timeout=60)
    connection.request("POST", "/openai/v1/completions", json.dumps({"model": "lm", "prompt": "a", "max_tokens": 5,
                                                                     "temperature": 0, "stream": True}))
    response = connection.getresponse()
    assert response.status == 200 and response.getheader("Content-Type").startswith("text/event-stream")
    events = [line for line in response.read().decode().split("\n\n") if line]
    assert all(event.startswith("data: ") for event in events) and events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] in ("stop", "length")


def test_a_stop_sequence_ends_the_completion_before_it(generator, client):
    text = text_of(in_process(generator[0], ["Once upon a time"], 24)["completions"][0])
    stop = text[5:7]
    answer = client.completions.create(model="lm", prompt="Once upon a time", max_tokens=24, temperature=0,
                                       stop=[stop])
    assert answer.choices[0].text == text[:text.find(stop)] and answer.choices[0].finish_reason == "stop"
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
        model="lm", prompt="Once upon a time", max_tokens=24, temperature=0, stop=stop, stream=True))
    assert streamed == answer.choices[0].text


@pytest.mark.parametrize("body, status, words", [
    ({"prompt": "x" * 30, "max_tokens": 40}, 400, ["maximum context length is 64 tokens", "71 tokens",
                                                   "31 in your prompt", "40 for the completion"]),
    ({"prompt": "x", "max_tokens": 49}, 400, ["max_tokens is 49", "48", "--generation_max_new_tokens"]),
    ({"prompt": "x" * 41}, 400, ["41 bytes", "40", "--generation_max_prompt_bytes"]),
    ({"prompt": "x", "top_p": 0.5}, 400, ["top_p", "top_k"]),
    ({"prompt": "x", "n": 2}, 400, ["n 2 is not supported"]),
    ({"prompt": "x", "temperature": 3}, 400, ["temperature must be a number from 0 to 2"]),
    ({"prompt": [1, 2]}, 400, ["prompt must be a string or a non-empty list of strings"]),
    ({"prompt": "x", "frobnicate": 1}, 400, ["Unrecognized request argument supplied: frobnicate"]),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, ["stop must be"]),
    ({"model": "nope", "prompt": "x"}, 404, ["The model `nope` does not exist"]),
    ({"prompt": "x", "logprobs": 6}, 400, ["logprobs must be an integer from 0 to 5"]),
    ({"prompt": "x", "echo": "yes"}, 400, ["echo must be true or false"]),
    ({"prompt": "x", "echo": 0}, 400, ["echo must be true or false"]),
    ({"prompt": "x", "logprobs": 1, "stream": True}, 400, ["echo and logprobs are not streamed here"]),
    ({"prompt": "x", "max_tokens": -1}, 400, ["max_tokens must be an integer from 0"]),
])
def test_bad_requests_are_refused_before_any_work_naming_what_is_wrong(server, body, status, words):
    steps = idle(decoder_of(server)).steps if server.server._core.generations._decoders else 0
    connection = http.client.HTTPConnection(server.rest_address, timeout=60)
    connection.request("POST", "/openai/v1/completions", json.dumps({"model": "lm", **body}))
    response = connection.getresponse()
    error = json.loads(response.read())["error"]
    assert response.status == status, error
    assert all(word in error["message"] for word in words), error["message"]
    assert error["type"] == ("invalid_request_error" if status == 400 else "not_found_error")
    if server.server._core.generations._decoders:
        assert decoder_of(server).steps == steps


def test_the_declared_prompt_tokens_check_the_context_without_a_tokenize_call(generator, tmp_path, monkeypatch):
    """With pipeline.json's prompt_tokens (every bytes-tokenizer export's) the decode loop counts a prompt itself:
    the same refusal, with the same numbers, as the tokenize signature's count (the fixture's export declares
    none), and no tokenize call on the way to a first token."""
    from pipeline.lm import tokenizers
    from serving.servable.runner import Runner

    path = tmp_path / "lm" / "1"
    generate.save(generator[0], path)
    (path / "assets.extra").mkdir()
    (path / "assets.extra" / "pipeline.json").write_text(json.dumps({"language_model": {
        "tokenizer": tokenizers.BYTES.facts()}}))
    called = []
    predict = Runner.predict
    monkeypatch.setattr(Runner, "predict", lambda self, inputs, name="serving_default", *rest: (
        called.append(name), predict(self, inputs, name, *rest))[1])
    with start(tmp_path / "lm") as running:
        called.clear()  # warm-up ran each signature once
        connection = http.client.HTTPConnection(running.rest_address, timeout=60)
        connection.request("POST", "/openai/v1/completions", json.dumps({"model": "lm", "prompt": "x" * 30,
                                                                         "max_tokens": 40}))
        response = connection.getresponse()
        message = json.loads(response.read())["error"]["message"]
        assert response.status == 400 and "71 tokens (31 in your prompt; 40 for the completion)" in message, message
        client = openai.OpenAI(base_url=f"http://{running.rest_address}/openai/v1", api_key="unused", max_retries=0)
        text = client.completions.create(model="lm", prompt="Once", max_tokens=6, temperature=0).choices[0].text
    expected = in_process(generator[0], [b"Once"], 6)
    assert text == text_of(expected["completions"][0]) and "tokenize" not in called, called


def test_malformed_json_is_a_400(server):
    connection = http.client.HTTPConnection(server.rest_address, timeout=60)
    connection.request("POST", "/openai/v1/completions", b'{"model": "lm", "prompt": ')
    response = connection.getresponse()
    assert response.status == 400 and "error" in json.loads(response.read())


def test_a_client_that_leaves_mid_stream_stops_costing_decode_steps(tmp_path):
    """Issue 30's case: a request for the whole context, cancelled after 5 tokens."""
    with start(long_model(tmp_path)) as running:
        connection = http.client.HTTPConnection(running.rest_address, timeout=60)
        connection.request("POST", "/openai/v1/completions", json.dumps({
            "model": "lm", "prompt": "a", "max_tokens": 1022, "temperature": 0.5, "seed": 1, "stream": True}))
        response = connection.getresponse()
        for _ in range(5):
            assert response.readline().startswith(b"data: ")
            response.readline()  # the blank line after each event
        connection.sock.shutdown(2)
        connection.close()
        decoder = decoder_of(running)
        left_at = decoder.steps
        idle(decoder)
        assert decoder.steps - left_at <= 3  # given up within a step or two of the disconnect
        assert decoder.steps < 200  # of the 1,021 asked for


def calls_and_writes(monkeypatch) -> list[str]:
    """Records, in order, the runner's prefill and decode_step calls and the completions' stream writes."""
    from serving.rest.openai import _Reply
    from serving.servable.runner import Runner

    events = []
    run, send = Runner.run_with_state, _Reply._send

    def recorded_run(self, name, *args):
        events.append(name)
        return run(self, name, *args)

    async def recorded_send(self, payload):
        events.append("write")
        await send(self, payload)

    monkeypatch.setattr(Runner, "run_with_state", recorded_run)
    monkeypatch.setattr(_Reply, "_send", recorded_send)
    return events


def stream_events(address: str, body: dict) -> list[bytes]:
    connection = http.client.HTTPConnection(address, timeout=60)
    connection.request("POST", "/openai/v1/completions", json.dumps({**body, "stream": True}))
    response = connection.getresponse()
    assert response.status == 200
    return [line for line in response.read().splitlines() if line.startswith(b"data: ")]


def test_a_streams_first_token_is_written_before_the_next_decode_step(generator, monkeypatch):
    """On a machine with few cores the step after a prefill would take the cores the event loop needs to write
    the first token: the decode loop waits until the stream wrote it (FIRST_TOKEN_WAIT_S; made long here, so the
    order does not depend on how fast this machine is)."""
    monkeypatch.setattr(decoder_module, "FIRST_TOKEN_WAIT_S", 10.0)
    events = calls_and_writes(monkeypatch)
    with start(generator[1]) as running:
        events.clear()  # the warm-up's calls
        started = time.monotonic()
        assert len(stream_events(running.rest_address, {"model": "lm", "prompt": "Once", "max_tokens": 6,
                                                        "temperature": 0})) >= 2
        assert events[:3] == ["prefill", "write", "decode_step"], events
        events.clear()
        client = openai.OpenAI(base_url=f"http://{running.rest_address}/openai/v1", api_key="unused", max_retries=0)
        client.completions.create(model="lm", prompt="Once", max_tokens=6, temperature=0)  # not streamed: no wait
        assert events[:2] == ["prefill", "decode_step"] and time.monotonic() - started < 5.0, events


def test_a_stream_that_never_says_it_wrote_holds_the_decode_loop_only_for_the_bound(generator, monkeypatch):
    monkeypatch.setattr(decoder_module, "FIRST_TOKEN_WAIT_S", 0.3)
    monkeypatch.setattr(decoder_module.Row, "first_token_sent", lambda self: None)
    with start(generator[1]) as running:
        started = time.monotonic()
        events = stream_events(running.rest_address, {"model": "lm", "prompt": "Once", "max_tokens": 6,
                                                      "temperature": 0})
        assert events[-1] == b"data: [DONE]" and 0.3 <= time.monotonic() - started < 5.0


@pytest.mark.parametrize("temperature, seed", [(0.0, 0), (0.9, 5)])
def test_grpc_predict_on_generate_is_answered_by_the_decode_loop_as_the_graph_answers(generator, server, temperature,
                                                                                       seed):
    prompts = ["Once upon a time", "é", ""]
    decoder = idle(decoder_of(server))
    before = decoder.steps
    got = grpc_generate(server.grpc_address, prompts, 20, temperature, seed)
    want = in_process(generator[0], prompts, 20, temperature, 0, seed)
    assert decoder.steps > before  # stepped by the decode loop, not one graph call
    for name in ("completions", "ids", "lengths"):
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    np.testing.assert_allclose(got["log_probs"], want["log_probs"], atol=1e-5, rtol=0)


def test_a_grpc_deadline_stops_the_generation_within_a_step(tmp_path):
    with start(long_model(tmp_path)) as running:
        grpc_generate(running.grpc_address, ["a"], 4)  # the decode loop exists
        decoder = idle(decoder_of(running))
        before = decoder.steps
        with pytest.raises(grpc.RpcError) as refused:
            grpc_generate(running.grpc_address, ["a"], 1023, temperature=0.5, timeout=0.05)
        assert refused.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        left_at = decoder.steps
        idle(decoder)
        assert decoder.steps - left_at <= 3 and decoder.steps - before < 1023 // 8


def test_a_passed_deadline_is_504_and_frees_the_row(generator):
    with start(generator[1], "--rest_api_timeout_in_ms=1") as running:
        client = openai.OpenAI(base_url=f"http://{running.rest_address}/openai/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.APIStatusError) as refused:
            client.completions.create(model="lm", prompt="a", max_tokens=48)
        assert refused.value.status_code == 504 and "--rest_api_timeout_in_ms" in refused.value.message
        assert idle(decoder_of(running)).steps < 40


def test_concurrent_completions_share_decode_steps_and_each_gets_its_own_text(generator, server, client):
    prompts = [f"prompt number {i}" for i in range(6)]
    client.completions.create(model="lm", prompt="a", max_tokens=1)
    decoder = idle(decoder_of(server))
    before, texts = decoder.steps, {}
    barrier = threading.Barrier(len(prompts))

    def ask(i):
        barrier.wait()
        # each request's one prompt is row 0 of its request: its key is (seed, 0), as generate's row 0
        answer = client.completions.create(model="lm", prompt=prompts[i], max_tokens=24, temperature=0.8, seed=11)
        texts[i] = answer.choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for i, prompt in enumerate(prompts):
        alone = in_process(generator[0], [prompt], 24, 0.8, 0, 11)["completions"][0]
        assert texts[i] == text_of(alone)
    assert decoder.most_rows >= 2  # they shared decode steps
    assert decoder.steps - before < len(prompts) * 3  # one after another: 6 × ⌈23 / 8⌉ calls at least


def complete_from(address: str, source: str, body: dict) -> dict:
    """A completion sent from the local address `source` (127.0.0.x): another client, as the server tells them."""
    host, port = address.split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=120, source_address=(source, 0))
    connection.request("POST", "/openai/v1/completions", json.dumps({"model": "lm", **body}))
    answer = json.loads(connection.getresponse().read())
    connection.close()
    return answer


def test_the_cache_budget_holds_rows_back_and_refuses_a_call_it_could_never_hold(generator):
    """--generation_max_cache_bytes of two rows' caches: four concurrent calls decode at most two rows at a time and
    each gets the model's own greedy text; a call of three prompts is 429 (gRPC: RESOURCE_EXHAUSTED) with the
    numbers, before any model work."""
    row_bytes = 2 * 1 * CONTEXT * 16 * 4  # keys and values, 1 block, width 16, float32
    prompts = [f"budget prompt {i}" for i in range(4)]
    with start(generator[1], f"--generation_max_cache_bytes={2 * row_bytes + row_bytes // 2}") as running:
        complete_from(running.rest_address, "127.0.0.1", {"prompt": "a", "max_tokens": 1})  # the decode loop is up
        decoder = idle(decoder_of(running))
        assert (decoder.protocol.cache_bytes_per_row, decoder.max_cache_rows) == (row_bytes, 2)
        texts, barrier = {}, threading.Barrier(len(prompts))

        def ask(i):
            barrier.wait()
            texts[i] = complete_from(running.rest_address, "127.0.0.1",
                                     {"prompt": prompts[i], "max_tokens": 30, "temperature": 0})

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        refused = complete_from(running.rest_address, "127.0.0.1", {"prompt": prompts[:3], "max_tokens": 4})
        idle(decoder)
    assert decoder.most_rows == 2  # shared steps, never more than the budget holds
    for i, prompt in enumerate(prompts):
        assert texts[i]["choices"][0]["text"] == text_of(in_process(generator[0], [prompt], 30)["completions"][0])
    assert refused["error"]["type"] == "rate_limit_exceeded"
    assert (f"3 rows need {3 * row_bytes:,} bytes of key/value cache ({row_bytes:,} per row), more than this "
            f"server's --generation_max_cache_bytes {2 * row_bytes + row_bytes // 2:,} (2 rows)") in \
        refused["error"]["message"]


def test_one_clients_many_calls_leave_another_client_a_small_batch_and_every_text_intact(tmp_path):
    """--generation_max_rows_per_client: one client's 6 long calls hold the whole batch while it is alone; once
    another client generates, the first keeps 2 rows in the steps and the others are paused (their cache rows set
    aside) and resume where they left off: the second client's steps hold 3 rows, not 7, and every text, paused
    or not, is still the model's own greedy text."""
    base = long_model(tmp_path)
    generate_signature = tf.saved_model.load(str(base / "1")).signatures["generate"]
    hostile = [f"hostile call {i}" for i in range(6)]
    with start(base, "--generation_max_rows_per_client=2") as running:
        complete_from(running.rest_address, "127.0.0.1", {"prompt": "a", "max_tokens": 1})  # the decode loop is up
        decoder = decoder_of(running)
        texts, step_rows = {}, []
        threads = [threading.Thread(target=lambda i=i: texts.__setitem__(i, complete_from(
            running.rest_address, "127.0.0.2", {"prompt": hostile[i], "max_tokens": 600, "temperature": 0})))
            for i in range(6)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 60
        while decoder.most_rows < 6 and time.monotonic() < deadline:  # alone, the client holds every row it asks for
            time.sleep(0.01)
        assert decoder.most_rows == 6
        decoder._on_step = lambda kind, rows, seconds: step_rows.append((kind, rows))
        good = complete_from(running.rest_address, "127.0.0.1", {"prompt": "well-behaved", "max_tokens": 40,
                                                                  "temperature": 0})
        joined = [kind for kind, _ in step_rows].index("prefill")  # the second client's row
        during = [rows for kind, rows in step_rows[joined:] if kind == "decode_step"]
        for thread in threads:
            thread.join()
        idle(decoder)
    assert decoder.paused_rows >= 4
    assert during and max(during) == 3  # 2 of the first client's rows + the second client's one
    want = {name: value.numpy() for name, value in generate_signature(
        prompts=tf.constant(hostile + ["well-behaved"]), max_new_tokens=tf.constant(600),
        temperature=tf.constant(0.0), top_k=tf.constant(0), seed=tf.constant(0, tf.int64)).items()}
    assert good["choices"][0]["text"] == text_of(want["completions"][-1][:40])
    for i in range(6):
        assert texts[i]["choices"][0]["text"] == text_of(want["completions"][i]), i


# ---- the parts, without a server ----

@pytest.mark.parametrize("peer, client", [("ipv4:10.0.0.7:51234", "10.0.0.7"), ("ipv6:[::1]:51234", "[::1]"),
                                          ("unix:/run/serving.sock", "/run/serving.sock"), ("", "")])
def test_a_calls_client_is_its_peer_address_without_the_port(peer, client):
    from types import SimpleNamespace

    from serving.generation.predict import client_of
    from serving.rest.routes import Context

    assert client_of(SimpleNamespace(peer=lambda: peer)) == client  # a gRPC call's context
    assert client_of(Context(client="192.168.1.9")) == "192.168.1.9"  # a REST request's
    assert client_of(None) == ""


def test_choice_text_holds_back_a_possible_stop_and_a_split_character():
    choice = ChoiceText(("END",))
    pieces = [b"ab", b"E", b"N", b"x", "é".encode()[:1], "é".encode()[1:], b"E", b"N", b"D", b"zz"]
    sent = [choice.add(Token(1, piece, -0.1, None)) for piece in pieces[:-1]]
    assert sent == ["ab", "", "", "ENx", "", "é", "", "", ""]
    assert choice.text == "abENxé" and choice.finish == "stop"


def test_choice_text_flushes_at_the_end_and_replaces_an_unfinished_character():
    choice = ChoiceText(())
    assert choice.add(Token(97, b"a", -1.0, None)) == "a"
    assert choice.add(Token(195, "é".encode()[:1], -1.0, "length")) == "\ufffd" and choice.finish == "length"
    assert choice.tokens == 2


def test_parse_completion_defaults_follow_openai():
    completion = parse_completion({"model": "lm", "prompt": "hi"}, Limits(100, 100, None))
    assert (completion.max_tokens, completion.temperature, completion.top_k, completion.stream) == (16, 1.0, 0, False)
    assert completion.prompts == [b"hi"] and 0 <= completion.seed < 2 ** 63
    with pytest.raises(OpenAIError, match="seed must be an integer"):
        parse_completion({"model": "lm", "prompt": "hi", "seed": "x"}, Limits(100, 100, None))


def test_hostile_completions_leave_well_behaved_clients_served_and_every_refusal_clear(generator, caplog):
    """Issue 30's hostile mix against one server: calls for the most tokens with prompts at the byte cap, clients
    that send and leave at once, streams that are never read, over-long asks; meanwhile well-behaved clients get
    the model's own text. Afterwards no row is left decoding and nothing in the log is a traceback."""
    import socket

    caplog.set_level("INFO")
    generated, base = generator
    with start(base, "--generation_max_prompt_bytes=40", "--rest_api_timeout_in_ms=20000") as running:
        host, port = running.rest_address.split(":")
        client = openai.OpenAI(base_url=f"http://{running.rest_address}/openai/v1", api_key="unused", max_retries=0)
        capped = "y" * 40
        statuses, held = [], []

        def raw(body: dict, read: bool) -> None:
            sock = socket.create_connection((host, int(port)))
            payload = json.dumps(body).encode()
            sock.sendall(b"POST /openai/v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
            if read:
                statuses.append(int(sock.recv(64).split()[1]))
                sock.close()
            else:
                held.append(sock)  # never read; closed at the end

        hostile = ([{"model": "lm", "prompt": capped, "max_tokens": CONTEXT - 41, "temperature": 1.0}] * 12
                   + [{"model": "lm", "prompt": capped, "max_tokens": CONTEXT, "stream": True}] * 6  # too many
                   + [{"model": "lm", "prompt": capped + "z", "max_tokens": 5}] * 6)  # over the byte cap
        threads = [threading.Thread(target=raw, args=(body, True)) for body in hostile]
        threads += [threading.Thread(target=raw, args=({"model": "lm", "prompt": capped, "max_tokens": CONTEXT - 41,
                                                        "stream": True}, False)) for _ in range(8)]
        good, want = [], text_of(in_process(generated, ["Once upon a time"], 20)["completions"][0])

        def well_behaved() -> None:
            for _ in range(4):
                good.append(client.completions.create(model="lm", prompt="Once upon a time", max_tokens=20,
                                                      temperature=0).choices[0].text)

        threads += [threading.Thread(target=well_behaved) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for sock in held:
            sock.close()
        assert good == [want] * 12
        assert sorted(set(statuses)) == [200, 400] and statuses.count(400) == 12
        idle(decoder_of(running))
        assert client.completions.create(model="lm", prompt="Once upon a time", max_tokens=20,
                                         temperature=0).choices[0].text == want  # still serving
    assert not [record for record in caplog.records if record.exc_info or "Traceback" in record.getMessage()]


def test_completions_are_logged_as_predict_calls_on_generate(generator, tmp_path):
    """The request log holds a completion as the Predict on `generate` it amounts to: `pipeline audit` and a
    warmup file read it as they read a TF Serving client's generate calls."""
    from tensorflow_serving.apis import prediction_log_pb2

    config = logged_models_config(tmp_path, "lm", generator[1])
    options = parse([f"--model_config_file={config}", "--port=0", "--rest_api_port=-1"])
    with ServerThread(options, build(options)) as running:
        client = openai.OpenAI(base_url=f"http://{running.rest_address}/openai/v1", api_key="unused", max_retries=0)
        answer = client.completions.create(model="lm", prompt=["Once upon a time", "é"], max_tokens=12, temperature=0)
        list(client.completions.create(model="lm", prompt="x", max_tokens=5, temperature=0.5, seed=3, stream=True))
    (path,) = tmp_path.glob("requests-lm-*.tfrecord")
    records = [prediction_log_pb2.PredictionLog.FromString(raw.numpy()) for raw in tf.data.TFRecordDataset(str(path))]
    assert [record.WhichOneof("log_type") for record in records] == ["predict_log", "predict_log"]
    first = records[0].predict_log
    assert first.request.model_spec.signature_name == "generate" and first.request.model_spec.version.value == 1
    assert tf.make_ndarray(first.request.inputs["prompts"]).tolist() == [b"Once upon a time", "é".encode()]
    assert int(tf.make_ndarray(first.request.inputs["max_new_tokens"])) == 12
    want = in_process(generator[0], ["Once upon a time", "é"], 12)
    np.testing.assert_array_equal(tf.make_ndarray(first.response.outputs["ids"]), want["ids"])
    assert [text.decode() for text in tf.make_ndarray(first.response.outputs["completions"])] == [
        c.text for c in answer.choices]
    second = records[1].predict_log.request
    assert int(tf.make_ndarray(second.inputs["seed"])) == 3 and float(tf.make_ndarray(second.inputs["temperature"])) == 0.5


def test_generation_is_seen_in_the_metrics(generator, tmp_path):
    monitoring = tmp_path / "monitoring.config"
    monitoring.write_text('prometheus_config { enable: true, path: "/metrics" }')
    with start(generator[1], f"--monitoring_config_file={monitoring}") as running:
        client = openai.OpenAI(base_url=f"http://{running.rest_address}/openai/v1", api_key="unused", max_retries=0)
        answer = client.completions.create(model="lm", prompt=["Once upon a time", "x"], max_tokens=10, temperature=0)
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="lm", prompt="x", max_tokens=CONTEXT)
        connection = http.client.HTTPConnection(running.rest_address, timeout=60)
        connection.request("GET", "/metrics")
        text = connection.getresponse().read().decode()
    from prometheus_client.parser import text_string_to_metric_families

    samples = {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
               for family in text_string_to_metric_families(text) for sample in family.samples}
    version = (("model_name", "lm"), ("version", "1"))
    assert samples["tensorflow_serving_generation_tokens_total", version] == answer.usage.completion_tokens
    assert samples["tensorflow_serving_generation_time_to_first_token_seconds_count", version] == 1
    finished = sum(value for (name, labels), value in samples.items()
                   if name == "tensorflow_serving_generation_finished_total" and dict(labels)["model_name"] == "lm")
    assert finished == 2  # one per prompt: stop or length
    assert any(name == "tensorflow_serving_request_count_total" and dict(labels)["rpc"] == "Completions"
               and dict(labels)["status"] == "INVALID_ARGUMENT" for name, labels in samples)
    assert samples["tensorflow_serving_generation_decode_rows_count", ()] >= 1


def test_a_sentencepiece_model_completes_and_streams_as_its_own_generate(tmp_path):
    """The decode protocol through the tokenizer the model was trained with (pipeline/lm/tokenizers.py): prompt tokens
    counted by it, each token's piece its own bytes, so the streamed pieces join to generate's completion."""
    from pipeline.lm import tokenizers
    from pipeline.data.text import embedded_corpus
    from pipeline.export.lm import language_model_facts

    tokenizer = tokenizers.SentencePieceTokenizer(
        tokenizers.train_sentencepiece([document.text for document in embedded_corpus()[::10]], 400))
    keras.utils.set_random_seed(6)
    model = causal_lm.build_causal_lm(tokenizer.vocab_size, context_length=64, num_layers=1, num_heads=2, width=16,
                                      mlp_width=32)
    generated = generate.Generator(model, tokenizer=tokenizer)
    path = tmp_path / "lm" / "1"
    generate.save(generated, path)
    (path / "assets.extra").mkdir()
    (path / "assets.extra" / "pipeline.json").write_text(json.dumps(
        {"op_libraries": ["tensorflow_text"], "language_model": language_model_facts(model, tokenizer)}))
    prompts = ["The ", "héllo 🙂"]
    want = in_process(generated, prompts, 12)
    with start(tmp_path / "lm") as running:
        client = openai.OpenAI(base_url=f"http://{running.rest_address}/openai/v1", api_key="unused", max_retries=0)
        answer = client.completions.create(model="lm", prompt=prompts, max_tokens=12, temperature=0)
        chunks = list(client.completions.create(model="lm", prompt=prompts, max_tokens=12, temperature=0,
                                                stream=True))
    assert [choice.text for choice in answer.choices] == [text_of(c) for c in want["completions"]]
    streamed = ["", ""]
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == [choice.text for choice in answer.choices]
    prompt_tokens = tokenizer.encode_padded(prompts)[1].numpy()
    assert answer.usage.prompt_tokens == int(prompt_tokens.sum()) + 2  # BOS each
    assert answer.usage.completion_tokens == int(want["lengths"].sum())


def teacher_forced(generated, prompt: bytes) -> np.ndarray:
    """log P(token t | BOS and the tokens before it) of each of the prompt's bytes, from the model's float32
    logits, PAD and BOS excluded as generation excludes them."""
    logits = generated.model(tf.constant([[causal_lm.BOS, *prompt]])).numpy()[0, :-1].astype(np.float64)
    logits[:, [causal_lm.PAD, causal_lm.BOS]] = -np.inf
    log_probs = logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True)) - logits.max(
        1, keepdims=True)
    return log_probs[np.arange(len(prompt)), list(prompt)]


def token_bytes(token: str) -> bytes:
    """A logprobs token's bytes: its text, or the bytes `bytes:\\xNN...` spells (a piece of a UTF-8 character)."""
    if token.startswith("bytes:"):
        return bytes(int(token[i + 2:i + 4], 16) for i in range(6, len(token), 4))
    return token.encode()


def test_echo_with_no_new_tokens_scores_the_prompt_as_the_model_does(generator, client):
    """Issue 44: a log-likelihood query (max_tokens 0, echo, logprobs), as evaluation tools send it: the prompt back,
    each of its tokens' log-probability given the ones before (the first given BOS), top alternatives, offsets."""
    generated, _ = generator
    prompts = ["Once upon a time", "é!"]
    answer = client.completions.create(model="lm", prompt=prompts, max_tokens=0, echo=True, logprobs=2)
    for prompt, choice in zip(prompts, answer.choices):
        assert choice.text == prompt and choice.finish_reason == "length"
        want = teacher_forced(generated, prompt.encode())
        np.testing.assert_allclose(choice.logprobs.token_logprobs, want, atol=1e-5)
        for token, log_prob, top in zip(choice.logprobs.tokens, choice.logprobs.token_logprobs,
                                        choice.logprobs.top_logprobs):
            assert token in top and top[token] == log_prob and len(top) <= 3  # the 2 best, and the token itself
            assert max(top.values()) >= log_prob
    ascii_choice, accented = answer.choices
    assert ascii_choice.logprobs.tokens == list("Once upon a time")
    assert ascii_choice.logprobs.text_offset == list(range(len("Once upon a time")))
    assert accented.logprobs.tokens == ["bytes:\\xc3", "bytes:\\xa9", "!"]  # é is two byte tokens
    assert accented.logprobs.text_offset == [0, 0, 1]
    assert answer.usage.prompt_tokens == (16 + 1) + (3 + 1) and answer.usage.completion_tokens == 0  # BOS counts


def test_logprobs_of_a_completion_are_the_decoders_own_and_echo_puts_the_prompt_first(generator, client):
    generated, _ = generator
    out = in_process(generated, [b"Once"], 10)
    plain = client.completions.create(model="lm", prompt="Once", max_tokens=10, temperature=0, logprobs=0)
    choice = plain.choices[0]
    made = int(out["lengths"][0])
    assert choice.text == text_of(out["completions"][0])
    assert b"".join(map(token_bytes, choice.logprobs.tokens)) == out["completions"][0]  # the untrained model's bytes
    np.testing.assert_allclose(choice.logprobs.token_logprobs, out["log_probs"][0, :made], atol=1e-5)
    assert choice.logprobs.top_logprobs is None  # logprobs 0: the tokens' own only
    echoed = client.completions.create(model="lm", prompt="Once", max_tokens=10, temperature=0, logprobs=1,
                                       echo=True).choices[0]
    assert echoed.text == "Once" + choice.text
    assert echoed.logprobs.tokens == list("Once") + choice.logprobs.tokens
    np.testing.assert_allclose(echoed.logprobs.token_logprobs[4:], choice.logprobs.token_logprobs, atol=1e-6)
    np.testing.assert_allclose(echoed.logprobs.token_logprobs[:4], teacher_forced(generated, b"Once"), atol=1e-5)
    greedy = [max(top, key=top.get) for top in echoed.logprobs.top_logprobs[4:]]
    assert greedy == choice.logprobs.tokens  # greedy: each token is its position's most likely
    assert client.completions.create(model="lm", prompt="Once", max_tokens=0).choices[0].text == ""


def post(address: str, path: str, body: dict) -> tuple[int, dict]:
    connection = http.client.HTTPConnection(address, timeout=60)
    connection.request("POST", f"/openai/v1/{path}", json.dumps(body))
    response = connection.getresponse()
    return response.status, json.loads(response.read())


def test_tokenize_and_detokenize_are_the_models_own_tokenizer_both_ways(server):
    status, tokenized = post(server.rest_address, "tokenize", {"model": "lm", "prompt": "é a"})
    assert status == 200, tokenized
    assert tokenized == {"count": 5, "max_model_len": CONTEXT, "tokens": [causal_lm.BOS, 0xC3, 0xA9, 32, 97]}
    _, bare = post(server.rest_address, "tokenize", {"model": "lm", "prompt": "é a", "add_special_tokens": False})
    assert bare["tokens"] == tokenized["tokens"][1:]
    status, text = post(server.rest_address, "detokenize", {"model": "lm", "tokens": tokenized["tokens"]})
    assert (status, text) == (200, {"prompt": "é a"})  # BOS is no text
    assert post(server.rest_address, "detokenize", {"model": "lm", "tokens": []}) == (200, {"prompt": ""})


@pytest.mark.parametrize("path, body, words", [
    ("tokenize", {"prompt": "x" * 41}, ["prompt is 41 bytes", "--generation_max_prompt_bytes"]),
    ("tokenize", {"prompt": 5}, ["prompt must be a string"]),
    ("tokenize", {"prompt": "x", "add_special_tokens": "no"}, ["add_special_tokens must be true or false"]),
    ("tokenize", {"prompt": "x", "frobnicate": 1}, ["Unrecognized request argument supplied: frobnicate"]),
    ("detokenize", {"tokens": [causal_lm.VOCAB_SIZE]}, ["each an integer from 0 to 258"]),
    ("detokenize", {"tokens": [1] * (CONTEXT + 1)}, ["at most 64 token ids"]),
    ("detokenize", {"tokens": [True]}, ["tokens must be a list"]),
    ("detokenize", {"tokens": "abc"}, ["tokens must be a list"]),
])
def test_bad_tokenize_and_detokenize_requests_are_400s_naming_the_field(server, path, body, words):
    status, answer = post(server.rest_address, path, {"model": "lm", **body})
    assert status == 400 and all(word in answer["error"]["message"] for word in words), answer
    assert post(server.rest_address, path, {"prompt": "x", "tokens": []})[0] == 400  # no model


def test_a_version_without_the_score_signature_refuses_logprobs_naming_it(tmp_path):
    class WithoutScore(generate.Generator):
        def signatures(self):
            return {name: f for name, f in super().signatures().items() if name not in ("score", "detokenize")}

    keras.utils.set_random_seed(4)
    model = causal_lm.build_causal_lm(context_length=CONTEXT, num_layers=1, num_heads=2, width=16, mlp_width=32)
    save_with_pad(WithoutScore(model), tmp_path / "lm" / "1")
    with start(tmp_path / "lm") as running:
        client = openai.OpenAI(base_url=f"http://{running.rest_address}/openai/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="has no score signature and PAD id in its export"):
            client.completions.create(model="lm", prompt="Once", max_tokens=2, logprobs=1)
        assert client.completions.create(model="lm", prompt="Once", max_tokens=2, echo=True).choices[0].text[:4] == "Once"
        status, answer = post(running.rest_address, "detokenize", {"model": "lm", "tokens": [97]})
        assert status == 400 and "has no detokenize in its export" in answer["error"]["message"]
