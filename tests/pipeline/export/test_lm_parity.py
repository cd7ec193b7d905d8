"""The language-model gate's recorded greedy agreement with float32 (lm_parity.record_agreement): the same-prefix
and the free-running measure on hand-made arrays whose answer is known, and on tiny untrained models: a model
against itself agrees fully both ways, and a model's same-prefix choices are its own free-running tokens up to
the step where its continuation parts from the reference."""

import keras
import numpy as np
import pytest

from pipeline import precision
from pipeline.lm import causal_lm, generate
from pipeline.lm.causal_lm import BOS, EOS, PAD
from pipeline.export import lm_parity

pytestmark = pytest.mark.timeout(120)

TINY = {"context_length": 32, "num_layers": 1, "num_heads": 2, "width": 16, "mlp_width": 32}


def gate() -> lm_parity.Gate:
    return lm_parity.Gate(trained_policy="mixed_float16", serving_policy="bfloat16", parity_tolerance=1e-5,
                          windows=2)


def one_hot_logits(prompts, reference, width, picks=None):
    """Teacher-forced logits [prompts, width, vocab] whose greedy choice at step s is reference[i, s] (picks
    overrides some), best by 1.0 over a runner-up; PAD and BOS higher still everywhere, so they must be masked."""
    logits = np.zeros((len(prompts), width, causal_lm.VOCAB_SIZE), np.float32)
    logits[..., [PAD, BOS]] = 100.0
    for i, prompt in enumerate(prompts):
        for s, token in enumerate(reference[i]):
            token = (picks or {}).get((i, s), token)
            logits[i, len(prompt) + s, token] = 2.0
            logits[i, len(prompt) + s, (token + 1) % causal_lm.NUM_BYTES] = 1.0
    return logits


def test_both_agreements_count_float32s_tokens_up_to_its_eos():
    prompts = [b"ab", b"c"]
    float32 = {"ids": np.array([[10, 11, 12], [20, EOS, PAD]])}  # the second row ended at its step 1
    forced = lm_parity.teacher_forced_ids(prompts, float32["ids"])
    assert forced.tolist() == [[BOS, 97, 98, 10, 11, 12], [BOS, 99, 20, EOS, PAD, PAD]]
    free_running = {"ids": np.array([[10, 11, 13], [21, 22, 23]])}
    served = one_hot_logits(prompts, float32["ids"], forced.shape[1], picks={(0, 1): 99})
    recorder = gate()
    recorder.record_agreement("bfloat16", prompts, float32, free_running, served,
                              one_hot_logits(prompts, float32["ids"], forced.shape[1]))
    agreement = recorder.report()["greedy_agreement_vs_float32"]
    assert agreement["steps"] == 3 and agreement["prompts"] == 2 and agreement["tokens"] == 5
    assert agreement["judged"] is False and agreement["policy"] == "bfloat16"
    # one of float32's 5 tokens chosen otherwise with the same prefix, where float32 led by 1.0
    assert agreement["same_prefix"] == {"agreement": 0.8, "disagreements": 1,
                                        "float32_top2_margin_where_disagreeing": {"max": 1.0, "median": 1.0}}
    # free-running: 10 and 11 shared, then the first row parts at step 2, the second at step 0
    assert agreement["free_running"] == {"agreement": 0.4, "identical_prompts": 0, "first_difference_steps": [0, 2]}
    assert "same prefix 0.8000, free-running 0.4000" in recorder.summary()


@pytest.fixture(scope="module")
def windows() -> np.ndarray:
    """Validation-like windows: BOS and text, so the prompts are their first 8 bytes."""
    text = b"The cat sat on the mat. A dog ran to the park and back. Birds sing when the rain stops. " * 4
    return np.array([[BOS, *text[i * 7: i * 7 + 31]] for i in range(6)], np.int32)


def tiny(seed: int) -> generate.Generator:
    keras.utils.set_random_seed(seed)
    with precision.policy_scope("float32"):
        return generate.Generator(causal_lm.build_causal_lm(**TINY))


def test_a_model_against_itself_agrees_fully_both_ways(windows):
    model = tiny(1)
    recorder = gate()
    lm_parity.record_agreement(recorder, model, model, windows, "float32")
    agreement = recorder.report()["greedy_agreement_vs_float32"]
    assert agreement["prompts"] == len(windows) and agreement["steps"] == 32 - 1 - lm_parity.PROMPT_BYTES
    assert agreement["same_prefix"]["agreement"] == 1.0 and agreement["same_prefix"]["disagreements"] == 0
    assert agreement["free_running"] == {"agreement": 1.0, "identical_prompts": len(windows),
                                         "first_difference_steps": []}


def test_same_prefix_choices_are_the_models_own_tokens_until_its_continuation_parts(windows):
    """At step 0 both measures ask the serving model the same question (the prompt alone), and until the free-running
    continuation first differs from float32's the prefixes are the same, so the choices must be too."""
    reference, other = tiny(1), tiny(2)
    prompts = lm_parity.prompts_of(windows)
    steps = lm_parity.new_tokens(TINY["context_length"], prompts)
    float32 = lm_parity.greedy(reference.generate, prompts, steps)
    free_running = lm_parity.greedy(other.generate, prompts, steps)["ids"]
    forced = lm_parity.teacher_forced_ids(prompts, float32["ids"])
    chosen = lm_parity.greedy_choices(lm_parity.logits(other, forced), prompts, steps)
    # and the reference's own teacher-forced choices are its greedy tokens (the cache matches a full pass)
    np.testing.assert_array_equal(lm_parity.greedy_choices(lm_parity.logits(reference, forced), prompts, steps),
                                  float32["ids"])
    differs = free_running != float32["ids"]
    parted = np.where(differs.any(axis=1), np.argmax(differs, axis=1), steps)
    assert (parted < steps).any(), "two random models should part somewhere"
    for row, step in enumerate(parted):
        np.testing.assert_array_equal(chosen[row, :step + 1], free_running[row, :step + 1])

    recorder = gate()
    lm_parity.record_agreement(recorder, reference, other, windows[:len(prompts)], "bfloat16")
    agreement = recorder.report()["greedy_agreement_vs_float32"]
    assert agreement["same_prefix"]["agreement"] == pytest.approx(np.mean(chosen == float32["ids"]))
    assert agreement["free_running"]["first_difference_steps"] == sorted(int(p) for p in parted if p < steps)


def test_the_teacher_forced_logits_are_read_where_generate_chooses(windows):
    """greedy_choices reads position len(prompt) + s: a float32 model's choices there on its own greedy tokens, fed
    as one batch with rows of different lengths, are those tokens."""
    model = tiny(3)
    prompts = [b"The", b"A dog ran", b""]
    float32 = lm_parity.greedy(model.generate, prompts, 12)
    forced = lm_parity.teacher_forced_ids(prompts, float32["ids"])
    assert forced.shape == (3, 1 + 9 + 12)
    np.testing.assert_array_equal(lm_parity.greedy_choices(lm_parity.logits(model, forced), prompts, 12),
                                  float32["ids"])


def test_the_frozen_weights_check_compares_log_probabilities_up_to_each_rows_first_flip():
    """Gate.frozen_weights: a near-tie may flip a token under the server's switch (the top log-probability moves a
    little, the text after it parts for good); a kernel computing something else moves the log-probabilities."""
    stepped = {"ids": np.array([[10, 11, 12], [20, 21, 22]]), "log_probs": np.array([[-1.0, -2.0, -3.0]] * 2)}
    flipped = {"ids": np.array([[10, 11, 12], [20, 99, 98]]),  # row 1 flips at step 1, then its text differs
               "log_probs": np.array([[-1.0, -2.0, -3.0], [-1.0, -2.0 + 1e-6, -9.0]])}
    close = gate()
    close.frozen_weights(flipped, stepped, tokens=3, compute_dtype="float32")
    [check] = close.checks
    assert check["passed"] and check["first_difference_steps"] == [1] and not check["identical_tokens"]
    assert check["max_log_prob_diff"] == pytest.approx(1e-6)
    for log_probs, dtype in (([[-1.0, -2.0, -3.0], [-1.0, -2.1, -9.0]], "bfloat16"),  # 0.1 at the flip
                             ([[-1.0, -2.0, -3.0 + 1e-4], [-1.0, -2.0, -9.0]], "float32"),
                             ([[np.nan, -2.0, -3.0], [-1.0, -2.0, -9.0]], "float32")):
        far = gate()
        far.frozen_weights({"ids": flipped["ids"], "log_probs": np.array(log_probs)}, stepped, 3, dtype)
        assert not far.passed and "log-probabilities differ by" in far.failures()[0], log_probs
