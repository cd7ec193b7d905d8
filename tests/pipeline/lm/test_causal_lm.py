"""The causal language model of issue 29 on tiny untrained models (its tokenizers: test_tokenizers.py): where each
part computes under the mixed policies, the cached decode against a full recompute, seeded sampling, EOS and
lengths, batches of prompts of different lengths, the SavedModel (in-process, tf.saved_model.load and a TF1 Session as
tensorflow_model_server loads it) and its op set, and the key/value cache's dtype."""

import logging
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import op_def_registry

from pipeline import models, precision
from pipeline.lm import causal_lm, generate
from pipeline.lm.causal_lm import BOS, EOS, PAD

pytestmark = pytest.mark.timeout(120)

TINY = {"context_length": 128, "num_layers": 2, "num_heads": 2, "width": 32, "mlp_width": 64}


def tiny_model(seed: int = 1, **overrides) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return causal_lm.build_causal_lm(**{**TINY, **overrides})


def run(function, prompts, max_new_tokens=16, temperature=0.0, top_k=0, seed=0) -> dict[str, np.ndarray]:
    outputs = function(tf.constant(prompts, tf.string), tf.constant(max_new_tokens, tf.int32),
                       tf.constant(temperature, tf.float32), tf.constant(top_k, tf.int32), tf.constant(seed, tf.int64))
    return {name: value.numpy() for name, value in outputs.items()}


@pytest.fixture
def policy(request):
    """The global policy request.param while the test builds; float32 again after it."""
    keras.config.set_dtype_policy(request.param)
    yield request.param
    keras.config.set_dtype_policy("float32")


@pytest.fixture(scope="module")
def model() -> keras.Model:
    keras.config.set_dtype_policy("float32")
    return tiny_model()


@pytest.fixture(scope="module")
def generator(model) -> generate.Generator:
    return generate.Generator(model)


def graph_nodes(concrete_function) -> list:
    graph = concrete_function.graph.as_graph_def()
    return list(graph.node) + [node for function in graph.library.function for node in function.node_def]


# ---- precision ----

@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"], indirect=True)
def test_scores_softmax_norms_embeddings_residuals_and_logits_are_float32(policy):
    reduced = keras.DTypePolicy(policy).compute_dtype
    model = tiny_model(dropout=0.1)
    dtypes = {path: layer.compute_dtype for path, layer in models.layer_paths(model).items()}
    float32 = ["token_embedding", "positions", "embedding_dropout", "block_1/norm_1", "block_1/norm_2",
               "block_1/attention/attention_dropout", "block_2/norm_1", "final_norm"]
    assert {path: dtypes[path] for path in float32} == dict.fromkeys(float32, "float32")
    in_policy = ["block_1/attention/query", "block_1/attention/key", "block_1/attention/value",
                 "block_1/attention/attention_output", "block_1/mlp_1", "block_1/mlp_2", "block_2/mlp_2"]
    assert {path: dtypes[path] for path in in_policy} == dict.fromkeys(in_policy, reduced)
    assert {variable.dtype for variable in model.weights} == {"float32"}

    # the project's rules (applied to every model the pipeline builds or loads) find nothing to change
    models.apply_precision_rules(model)
    assert {path: layer.compute_dtype for path, layer in models.layer_paths(model).items()} == dtypes

    forward = tf.function(lambda ids: model(ids, training=False)).get_concrete_function(
        tf.TensorSpec([None, None], tf.int32))
    assert forward.structured_outputs.dtype == tf.float32
    nodes = graph_nodes(forward)
    dtype_of = {node.name: tf.dtypes.as_dtype(node.attr["T"].type) for node in nodes if "T" in node.attr}
    softmax = [node.name for node in nodes if node.op == "Softmax"]
    assert len(softmax) == TINY["num_layers"] and {dtype_of[name] for name in softmax} == {tf.float32}
    assert {dtype_of[node.name] for node in nodes if node.op == "BatchMatMulV2"} == {tf.float32}  # scores, mix
    assert tf.as_dtype(reduced) in {dtype_of[node.name] for node in nodes if node.op == "MatMul"}  # projections
    # no rounding of the attention weights on the way to their weighted sum
    assert not [node.name for node in nodes if node.op == "Cast" and node.input[0].split(":")[0] in softmax]


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"], indirect=True)
def test_under_training_policies_the_embedding_tables_stay_float32_in_model_keras_too(tmp_path, policy):
    model = tiny_model()
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    for built in (model, loaded):
        tables = built.get_layer("token_embedding").embeddings, built.get_layer("positions").positions
        assert [table.dtype for table in tables] == ["float32", "float32"]
    ids = tf.constant([[BOS, 1, 2, 3, 200]])
    np.testing.assert_array_equal(loaded(ids).numpy(), model(ids).numpy())


@pytest.mark.parametrize("policy", ["bfloat16", "float16"], indirect=True)
def test_half_precision_serving_stores_the_embedding_tables_in_half_and_computes_from_them_in_float32(policy):
    """export.serving_policy float16/bfloat16 rebuilds under the pure policy: the tables are stored in it like every
    other weight (norms aside), and what they produce, the residual stream and the logits are float32."""
    with precision.policy_scope("float32"):
        float32 = tiny_model()
    model = tiny_model(seed=2)
    models.copy_weights(float32, model)
    embedding, positions = model.get_layer("token_embedding"), model.get_layer("positions")
    assert embedding.embeddings.dtype == policy and positions.positions.dtype == policy
    assert embedding.compute_dtype == positions.compute_dtype == "float32"
    float32_weights = {variable.path for variable in model.weights if "norm" in variable.path}
    assert {variable.path for variable in model.weights if variable.dtype == "float32"} == float32_weights

    # the lookups read the stored (rounded) rows and cast them to float32: exactly float32's table rounded once
    ids = tf.constant([[BOS, 1, 2, 3, 200, 999]])  # 999: out of the vocabulary, the extra row
    rounded = tf.cast(tf.cast(float32.get_layer("token_embedding").embeddings, policy), tf.float32).numpy()
    looked_up = embedding(ids)
    assert looked_up.dtype == tf.float32
    np.testing.assert_array_equal(looked_up.numpy()[0], rounded[[BOS, 1, 2, 3, 200, causal_lm.VOCAB_SIZE]])
    assert positions.at(tf.constant([0, 5])).dtype == tf.float32

    # the embedding, the positions' sum (the residual stream's start), every block's output and the logits are
    # float32 as computed (a DecoderBlock's symbolic output spec says its compute dtype; what it returns is float32)
    stream = keras.Model(model.input, [embedding.output, positions.output,
                                       *[block.output for block in causal_lm.blocks(model)], model.output])
    assert [tensor.dtype for tensor in stream(ids[:, :5])] == [tf.float32] * 5
    forward = tf.function(lambda ids: model(ids, training=False)).get_concrete_function(
        tf.TensorSpec([None, None], tf.int32))
    assert forward.structured_outputs.dtype == tf.float32
    nodes = graph_nodes(forward)
    dtype_of = {node.name: tf.dtypes.as_dtype(node.attr["T"].type) for node in nodes if "T" in node.attr}
    gathered = {node.name: tf.dtypes.as_dtype(node.attr["Tparams"].type) for node in nodes
                if node.op == "GatherV2" and tf.dtypes.as_dtype(node.attr["Tparams"].type).is_floating}
    assert set(gathered.values()) == {tf.as_dtype(policy)}  # the embedding's rows, read in their stored dtype...
    cast = {node.input[0].split(":")[0]: tf.dtypes.as_dtype(node.attr["DstT"].type) for node in nodes
            if node.op == "Cast"}
    assert {cast.get(name) for name in gathered} == {tf.float32}  # ...and cast to float32 right after the lookup
    # the scores, the weighted sums and the tied logits (BatchMatMulV2), every residual AddV2 of [.., width]
    assert {dtype_of[node.name] for node in nodes if node.op == "BatchMatMulV2"} == {tf.float32}
    assert tf.as_dtype(policy) in {dtype_of[node.name] for node in nodes if node.op == "MatMul"}  # the blocks
    np.testing.assert_allclose(model(ids[:, :5]).numpy(), float32(ids[:, :5]).numpy(), atol=0.05)

    # the cached decode: float32 logits, a cache in the policy's dtype
    logits, caches = causal_lm.prefill(model, ids[:, :3], tf.constant([2]))
    logits, caches = causal_lm.decode_step(model, tf.constant([33]), tf.constant([3]), caches)
    assert logits.dtype == tf.float32 and caches[0][0].dtype == tf.as_dtype(policy)


@pytest.mark.parametrize("policy", ["mixed_bfloat16"], indirect=True)
def test_the_key_value_cache_is_bfloat16_under_mixed_bfloat16(policy):
    model = tiny_model()
    assert causal_lm.cache_dtype(model) == "bfloat16"
    ids = tf.constant([[BOS, 104, 105]])
    logits, caches = causal_lm.prefill(model, ids, tf.constant([2]))
    logits, caches = causal_lm.decode_step(model, tf.constant([33]), tf.constant([3]), caches)
    assert logits.dtype == tf.float32
    head_dim = TINY["width"] // TINY["num_heads"]
    for keys, values in caches:
        for tensor in (keys, values):
            assert tensor.dtype == tf.bfloat16
            assert tensor.shape == (1, TINY["num_heads"], TINY["context_length"], head_dim)
            assert tensor.numpy().nbytes == tensor.shape.num_elements() * 2  # half of float32's bytes

    # and the generate loop carries the caches in bfloat16 from step to step
    loop = generate.Generator(model).generate.get_concrete_function()
    carried = [tf.dtypes.as_dtype(t) for node in graph_nodes(loop) if node.op in ("While", "StatelessWhile")
               for t in node.attr["T"].list.type]
    assert carried.count(tf.bfloat16) == 2 * TINY["num_layers"]


# ---- the cache against a full recompute ----

def test_the_cached_decode_matches_a_full_recompute_step_by_step(model, generator):
    prompt = "The cache must not change a thing. "
    cached = run(generator.generate, [prompt], max_new_tokens=64)
    assert cached["ids"].shape == (1, 64) and cached["lengths"].tolist() == [64]  # no EOS: 64 tokens to compare
    recomputed = run(generate.recompute_generate(model), [prompt], max_new_tokens=64)
    np.testing.assert_array_equal(cached["ids"], recomputed["ids"])
    np.testing.assert_allclose(cached["log_probs"], recomputed["log_probs"], atol=1e-5, rtol=0)

    prompt_ids = [BOS, *prompt.encode()]
    n = len(prompt_ids)
    sequence = tf.constant([prompt_ids + cached["ids"][0].tolist()])
    expected = model(sequence, training=False).numpy()[0, n - 1: n + 63]  # the logits before each new token
    logits, caches = causal_lm.prefill(model, sequence[:, :n], tf.constant([n - 1]))
    step = tf.function(lambda token, position, caches: causal_lm.decode_step(model, token, position, caches))
    steps = [logits.numpy()[0]]
    for i in range(63):
        logits, caches = step(sequence[:, n + i], tf.constant([n + i]), caches)
        steps.append(logits.numpy()[0])
    np.testing.assert_allclose(np.stack(steps), expected, atol=1e-5, rtol=0)


# ---- sampling, EOS, batches, long prompts ----

def test_sampling_is_seeded_and_temperature_zero_is_greedy(generator):
    prompts = ["Once upon a time", "x"]
    sampled = run(generator.generate, prompts, 24, temperature=1.0, seed=7)
    np.testing.assert_array_equal(run(generator.generate, prompts, 24, temperature=1.0, seed=7)["ids"],
                                  sampled["ids"])
    assert not np.array_equal(run(generator.generate, prompts, 24, temperature=1.0, seed=8)["ids"], sampled["ids"])
    assert not np.isin(sampled["ids"], [BOS]).any()
    assert (sampled["log_probs"] <= 0).all() and np.isfinite(sampled["log_probs"]).all()

    greedy = run(generator.generate, prompts, 24)
    np.testing.assert_array_equal(run(generator.generate, prompts, 24, temperature=0.0, top_k=5, seed=99)["ids"],
                                  greedy["ids"])
    top_1 = run(generator.generate, prompts, 24, temperature=0.7, top_k=1, seed=3)
    np.testing.assert_array_equal(top_1["ids"], greedy["ids"])
    np.testing.assert_array_equal(top_1["log_probs"], 0.0)  # one candidate: probability 1


def test_rows_stop_at_eos_with_padding_after_it():
    model = tiny_model(seed=2, tied_embeddings=False)
    generator = generate.Generator(model)
    bias = model.get_layer("logits").bias
    bias.assign(tf.one_hot(EOS, causal_lm.VOCAB_SIZE) * 100.0)
    first = run(generator.generate, ["x", "a longer prompt"], 8)
    assert first["ids"].tolist() == [[EOS] + [PAD] * 7] * 2
    assert first["lengths"].tolist() == [0, 0] and first["completions"].tolist() == [b"", b""]
    np.testing.assert_allclose(first["log_probs"], 0.0, atol=1e-6)

    bias.assign(tf.one_hot(EOS, causal_lm.VOCAB_SIZE) * 4.0)  # EOS about one step in six
    out = run(generator.generate, ["a", "b", "c", "d", "e", "f"], 24, temperature=1.0, seed=5)
    for ids, length, log_probs, completion in zip(out["ids"], out["lengths"], out["log_probs"], out["completions"]):
        ends = np.flatnonzero(ids == EOS)
        end = ends[0] if len(ends) else len(ids)
        assert length == end and completion == bytes(ids[:end].tolist())
        assert (ids[end + 1:] == PAD).all() and (log_probs[end + 1:] == 0).all() and (log_probs[:end + 1] < 0).all()
    assert len(set(out["lengths"].tolist())) > 2  # rows ended at different steps


def test_a_batch_of_different_lengths_gives_each_prompt_what_it_gets_alone(generator):
    prompts = ["", "a", "héllo, wörld", "a much longer prompt than the others in this batch"]
    batch = run(generator.generate, prompts, 20)
    for i, prompt in enumerate(prompts):
        alone = run(generator.generate, [prompt], 20)
        np.testing.assert_array_equal(batch["ids"][i], alone["ids"][0], err_msg=prompt)
        assert batch["completions"][i] == alone["completions"][0] and batch["lengths"][i] == alone["lengths"][0]
        np.testing.assert_allclose(batch["log_probs"][i], alone["log_probs"][0], atol=1e-5, rtol=0)


def test_a_sampled_row_depends_on_its_own_seed_and_index_not_on_the_rows_beside_it(generator):
    alone = run(generator.generate, ["é"], 16, temperature=1.0, top_k=20, seed=11)
    beside = run(generator.generate, ["é", "a much longer prompt", "x"], 16, temperature=1.0, top_k=20, seed=11)
    np.testing.assert_array_equal(beside["ids"][0], alone["ids"][0])
    np.testing.assert_allclose(beside["log_probs"][0], alone["log_probs"][0], atol=1e-5, rtol=0)
    twice = run(generator.generate, ["é", "é"], 16, temperature=1.0, top_k=20, seed=11)
    assert not np.array_equal(twice["ids"][0], twice["ids"][1])  # a row's index is part of its key


@pytest.mark.parametrize("settings", [dict(temperature=0.0, top_k=0, seed=0), dict(temperature=0.9, top_k=20, seed=3)])
def test_stepping_the_decode_protocol_gives_what_generate_gives(generator, settings):
    """prefill then decode_step, a token at a time as python -m serving drives them, rows at different lengths."""
    prompts, new = [b"Once upon", b"\xc3\xa9", b""], 12
    rows = len(prompts)
    row_settings = {"temperature": tf.fill([rows], settings["temperature"]), "top_k": tf.fill([rows], settings["top_k"]),
                    "seed": tf.fill([rows], tf.constant(settings["seed"], tf.int64)), "row": tf.range(rows)}
    out = generator.prefill(tf.constant(prompts), tf.fill([rows], new), **row_settings)
    assert out["position"].numpy().tolist() == [len(p) + 1 for p in prompts]  # BOS + the prompt
    tokens, pieces = [out["token"].numpy()[:, None]], [out["piece"].numpy()[:, None]]
    step = 1
    for steps in (1, 3, 1, 6):  # calls of one token and of several, as the server's decode loop makes them
        caches = {name: value for name, value in out.items() if name.startswith(generate.CACHE_PREFIX)}
        assert len(caches) == 2 * 2 and all(c.shape[2] == generator.context_length for c in caches.values())
        positions = tf.constant([len(p) + step for p in prompts])  # BOS + prompt, then one per token
        last = tf.constant(tokens[-1][:, -1])
        out = generator.decode_step(last, positions, tf.fill([rows], step), **row_settings, steps=tf.constant(steps),
                                    caches=caches)
        assert out["token"].shape == (rows, steps) and out["finished"].shape == (rows, steps)
        tokens.append(out["token"].numpy())
        pieces.append(out["piece"].numpy())
        step += steps
    assert step == new
    whole = run(generator.generate, [p.decode() for p in prompts], new, **settings)
    stepped, pieces = np.concatenate(tokens, axis=1), np.concatenate(pieces, axis=1)
    for i in range(rows):
        end = int(np.argmax(whole["ids"][i] == EOS)) if (whole["ids"][i] == EOS).any() else new
        np.testing.assert_array_equal(stepped[i, :end], whole["ids"][i, :end])
        assert b"".join(pieces[i, :end]) == whole["completions"][i]
    assert generator.tokenize(tf.constant(prompts))["prompt_tokens"].numpy().tolist() == [10, 3, 1]


def test_decode_step_writes_its_own_copy_of_the_cache_never_the_callers(generator):
    """The cache is written in place (causal_lm.write_in_place) into a copy taken once per call: the tensors a
    caller passed in stay as they were, so calling twice from the same cache gives the same tokens."""
    settings = {"temperature": tf.zeros([2]), "top_k": tf.zeros([2], tf.int32), "seed": tf.zeros([2], tf.int64),
                "row": tf.range(2)}
    out = generator.prefill(tf.constant([b"Once upon", b"a"]), tf.fill([2], 8), **settings)
    caches = {name: value for name, value in out.items() if name.startswith(generate.CACHE_PREFIX)}
    before = {name: value.numpy().copy() for name, value in caches.items()}
    calls = [generator.decode_step(out["token"], out["position"], tf.ones([2], tf.int32), **settings,
                                   steps=tf.constant(4), caches=caches) for _ in range(2)]
    for name, value in caches.items():
        np.testing.assert_array_equal(value.numpy(), before[name])
    np.testing.assert_array_equal(calls[0]["token"].numpy(), calls[1]["token"].numpy())
    written = calls[0][f"{generate.CACHE_PREFIX}keys_0"].numpy()
    positions = out["position"].numpy()
    assert all(np.abs(written[i, :, positions[i]:positions[i] + 4]).sum() > 0 for i in range(2))  # the 4 new ones
    assert np.abs(before[f"{generate.CACHE_PREFIX}keys_0"][:, :, positions.max():]).sum() == 0  # not the caller's


def test_long_prompts_keep_bos_and_their_last_bytes_and_max_new_tokens_fits_the_context(generator):
    ids, lengths = generate.prompt_ids(tf.constant(["abcdef", "ab", ""]), 4)
    a, b, c = (ord(char) for char in "abc")
    assert ids.numpy().tolist() == [[BOS, ord("d"), ord("e"), ord("f")], [BOS, a, b, PAD], [BOS, PAD, PAD, PAD]]
    assert lengths.numpy().tolist() == [4, 3, 1]

    context = TINY["context_length"]
    assert run(generator.generate, ["z" * 200], 500)["ids"].shape == (1, context - 1)  # the prompt is BOS alone
    tail = "only the last bytes count"
    max_new = context - 1 - len(tail)
    np.testing.assert_array_equal(run(generator.generate, ["x" * 100 + tail], max_new)["ids"],
                                  run(generator.generate, [tail], max_new)["ids"])
    nothing = run(generator.generate, ["abc", "d"], 0)
    assert nothing["ids"].shape == (2, 0) and nothing["completions"].tolist() == [b"", b""]
    assert run(generator.generate, [], 5)["ids"].shape == (0, 5)


# ---- saving ----

def test_the_model_saves_and_loads_as_a_keras_file(tmp_path, model):
    untied = tiny_model(seed=3, tied_embeddings=False, dropout=0.1)
    ids = tf.constant([[BOS, 1, 2, 3, 200]])
    for built in (model, untied):
        path = tmp_path / f"{built.name}_{len(built.weights)}.keras"
        built.save(path)
        loaded = keras.saving.load_model(path)
        np.testing.assert_array_equal(loaded(ids).numpy(), built(ids).numpy())


def test_the_savedmodel_generates_as_in_process_and_holds_core_ops_only(tmp_path, model, generator):
    path = tmp_path / "lm"
    generate.save(generator, path)
    prompts = ["Once upon", "é"]
    calls = [{"max_new_tokens": 12, "temperature": 0.0, "top_k": 0, "seed": 0},
             {"max_new_tokens": 12, "temperature": 0.9, "top_k": 20, "seed": 11}]
    expected = [run(generator.generate, prompts, **kwargs) for kwargs in calls]

    loaded = tf.saved_model.load(str(path))
    signature = loaded.signatures["generate"]
    assert {name: spec.dtype for name, spec in signature.structured_input_signature[1].items()} == {
        "prompts": tf.string, "max_new_tokens": tf.int32, "temperature": tf.float32, "top_k": tf.int32,
        "seed": tf.int64}
    assert {name: spec.dtype for name, spec in signature.structured_outputs.items()} == {
        "completions": tf.string, "ids": tf.int32, "lengths": tf.int32, "log_probs": tf.float32}
    names = [spec.name for spec in generate.GENERATE_SIGNATURE]
    for kwargs, want in zip(calls, expected):
        got = run(lambda *args: signature(**dict(zip(names, args))), prompts, **kwargs)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    ids = tf.constant([[BOS, *b"teacher forcing"]])
    np.testing.assert_allclose(loaded.signatures["serving_default"](ids=ids)["logits"].numpy(), model(ids).numpy(),
                               atol=1e-6, rtol=0)

    # tensorflow_model_server loads a SavedModel into a TF1 Session and runs the restore op: so does this
    with tf.Graph().as_default() as graph, tf.compat.v1.Session(graph=graph) as session:
        definition = tf.compat.v1.saved_model.loader.load(session, ["serve"], str(path)).signature_def["generate"]
        feeds = {"prompts": prompts, "max_new_tokens": 12, "temperature": 0.9, "top_k": 20, "seed": 11}
        got = session.run({name: info.name for name, info in definition.outputs.items()},
                          {definition.inputs[name].name: value for name, value in feeds.items()})
    for name in expected[1]:
        np.testing.assert_array_equal(got[name], expected[1][name], err_msg=name)

    ops = generate.saved_model_op_types(path)
    assert not [op for op in ops if op.startswith("Xla") or "PyFunc" in op]
    assert ops <= generate.SERVING_OPS, sorted(ops - generate.SERVING_OPS)
    if "tensorflow_text" not in sys.modules:  # (a sentencepiece test may have imported it) every op is TensorFlow's
        assert all(op_def_registry.get(op) is not None for op in ops)


def test_generators_traced_once_each_are_not_reported_as_retracing(caplog, model):
    """The export's gate traces a trained, a float32 and a recompute Generator: TensorFlow counted them as one
    function retracing and warned on every language-model export."""
    with caplog.at_level(logging.WARNING, "tensorflow"):
        for _ in range(6):
            run(generate.Generator(model).generate, ["ab"], 2)
    assert "retracing" not in caplog.text


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_remat_trains_to_the_same_weights_and_survives_saving(policy, tmp_path):
    """model.remat recomputes each block in the backward pass: the same gradients, so the same weights after two
    Adam steps (within float32 rounding of the recomputed ops), and a remat model saves and loads as one."""
    rng = np.random.default_rng(0)
    x = rng.integers(3, 250, (4, 32)).astype(np.int32)
    y = rng.integers(3, 250, (4, 32)).astype(np.int64)
    weights = {}
    for remat in (False, True):
        keras.utils.set_random_seed(3)
        with precision.policy_scope(policy):
            model = causal_lm.build_causal_lm(context_length=32, num_layers=2, num_heads=2, width=16, mlp_width=32,
                                              remat=remat)
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True))
        for _ in range(2):
            model.train_on_batch(x, y)
        weights[remat] = model.get_weights()
    for plain, recomputed in zip(weights[False], weights[True]):
        np.testing.assert_allclose(recomputed, plain, rtol=1e-5, atol=1e-6)
    assert causal_lm.blocks(model)[0].remat and causal_lm.blocks(model)[0].get_config()["remat"] is True
    model.save(tmp_path / "remat.keras")
    loaded = keras.saving.load_model(tmp_path / "remat.keras", compile=False)
    assert causal_lm.blocks(loaded)[0].remat
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(loaded(x)), keras.ops.convert_to_numpy(model(x)))
    keras.config.set_dtype_policy("float32")
