"""speed.median_seconds: warm-up calls untimed, candidates interleaved round by round, the budget bounds slow calls."""

import time

from pipeline import speed


def test_warmup_is_untimed_and_every_candidate_runs_once_per_round():
    order = []

    def call(name, seconds):
        def run():
            order.append(name)
            time.sleep(seconds)
        return run

    first = {"slow": True}

    def warming():  # slow only on its first call, which the warm-up takes
        order.append("warming")
        time.sleep(0.2 if first.pop("slow", False) else 0.001)

    seconds = speed.median_seconds({"quick": call("quick", 0.001), "warming": warming}, warmup=1, min_rounds=5,
                                   max_rounds=5, budget_s=10)
    assert order == ["quick", "warming"] + ["quick", "warming"] * 5
    assert seconds["warming"] < 0.1 and set(seconds) == {"quick", "warming"}


def test_the_budget_stops_slow_calls_after_the_minimum_rounds_and_quick_ones_at_the_maximum():
    slow, quick = [], []
    seconds = speed.median_seconds({"slow": lambda: (slow.append(1), time.sleep(0.05))}, warmup=0, min_rounds=3,
                                   max_rounds=100, budget_s=0.01)
    assert len(slow) == 3 and seconds["slow"] >= 0.05
    speed.median_seconds({"quick": lambda: quick.append(1)}, warmup=0, min_rounds=3, max_rounds=20, budget_s=10)
    assert len(quick) == 20
