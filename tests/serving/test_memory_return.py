"""serving/memory_return.py's MemoryReturner, on a model of glibc's heap: RSS is what is in use plus what was freed and
kept; a trim gives back the kept part. The case a test run met: a trim while a burst is still in flight gives
little back, and what that burst frees after it must still be given back."""

from serving.memory_return import GROWTH_BYTES, INTERVAL_S, MAX_INTERVAL_S, MemoryReturner

MB = 2**20


class Heap:
    def __init__(self, in_use: int):
        self.in_use, self.kept, self.trims = in_use, 0, 0

    def resident(self) -> int:
        return self.in_use + self.kept

    def trim(self, pad: int) -> int:
        self.trims += 1
        self.kept = 0
        return 1

    def free(self, amount: int) -> None:
        self.in_use -= amount
        self.kept += amount


def test_memory_freed_after_a_trim_in_flight_is_given_back_at_the_next_look():
    heap = Heap(700 * MB)
    memory = MemoryReturner(trim=heap.trim, resident=heap.resident)
    memory.low = heap.resident()
    heap.in_use += 100 * MB  # a burst of requests in flight
    memory.check()
    assert heap.trims == 1 and heap.resident() == 800 * MB and memory.wait_s == 2 * INTERVAL_S  # nothing to give
    heap.free(100 * MB)  # the burst ends: freed, kept by the heap
    memory.check()
    assert heap.trims == 2 and heap.resident() == 700 * MB and memory.wait_s == INTERVAL_S
    memory.check()
    assert heap.trims == 2  # back at the low: no trim


def test_a_working_set_that_grew_for_good_becomes_the_new_low():
    heap = Heap(700 * MB)
    memory = MemoryReturner(trim=heap.trim, resident=heap.resident)
    memory.low = heap.resident()
    heap.in_use += 500 * MB  # a version loaded
    waits = []
    while memory.low < heap.resident():
        memory.check()
        waits.append(memory.wait_s)
    assert waits[:-1] == [2 * INTERVAL_S * 2**i for i in range(len(waits) - 1)] and waits[-2] == MAX_INTERVAL_S
    assert waits[-1] == INTERVAL_S and memory.low == 1200 * MB
    trims = heap.trims
    memory.check()
    assert heap.trims == trims  # steady at its new size: no more trims


def test_growth_below_the_threshold_is_left_alone():
    heap = Heap(700 * MB)
    memory = MemoryReturner(trim=heap.trim, resident=heap.resident)
    memory.low = heap.resident()
    heap.in_use += GROWTH_BYTES - 1
    memory.check()
    assert heap.trims == 0
