"""The decode loops of the served language models: one Decoder per loaded version that has the decode protocol
(serving/generation/decoder.py), started on its first generation and stopped once the version is no longer served
and its last row is done."""

from __future__ import annotations

import threading
import weakref

from serving.generation.decoder import DEFAULT_MAX_ROWS, DecodeProtocol, Decoder
from serving.limits import DEFAULT_GENERATION_MAX_ROWS_PER_CLIENT
from serving.manager.model_manager import ModelManager
from serving.monitoring import Metrics
from serving.servable.runner import Runner


class Generations:
    """Args:
        manager: the loaded models.
        max_rows: rows one decode step may hold (the batching flags' max_batch_size).
        metrics: where decode steps are counted (None: nowhere).
        max_rows_per_client: a client's rows in a step while other clients generate
            (--generation_max_rows_per_client).
        max_cache_bytes: the key/value cache one version's rows may hold (--generation_max_cache_bytes; 0: none).
    """

    def __init__(self, manager: ModelManager, max_rows: int = DEFAULT_MAX_ROWS, metrics: Metrics | None = None,
                 max_rows_per_client: int = DEFAULT_GENERATION_MAX_ROWS_PER_CLIENT, max_cache_bytes: int = 0) -> None:
        self.manager, self.max_rows, self.metrics = manager, max_rows, metrics
        self.max_rows_per_client, self.max_cache_bytes = max_rows_per_client, max_cache_bytes
        self._decoders: dict[Runner, Decoder] = {}  # by the Runner object itself (identity)
        self._protocols: weakref.WeakKeyDictionary[Runner, DecodeProtocol | None] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def protocol(self, runner: Runner) -> DecodeProtocol | None:
        """The runner's decode protocol (None: it cannot be stepped), read once per runner."""
        with self._lock:
            if runner not in self._protocols:
                self._protocols[runner] = DecodeProtocol.of(runner)
            return self._protocols[runner]

    def decoder(self, runner: Runner) -> Decoder:
        """The runner's decode loop, started on first use; decode loops of versions no longer served, with no rows
        left, are stopped on the way."""
        protocol = self.protocol(runner)
        if protocol is None:
            raise ValueError(f"model {runner.model_name} version {runner.version} has no decode protocol")
        with self._lock:
            self._stop_unserved()
            decoder = self._decoders.get(runner)
            if decoder is None:
                on_step = self.metrics.observe_decode_step if self.metrics is not None else None
                decoder = self._decoders[runner] = Decoder(runner, protocol, self.max_rows, on_step,
                                                           self.max_rows_per_client, self.max_cache_bytes)
            return decoder

    def stop(self) -> None:
        with self._lock:
            decoders, self._decoders = list(self._decoders.values()), {}
        for decoder in decoders:
            decoder.stop()

    def _stop_unserved(self) -> None:
        served = {id(runner) for name in self.manager.model_names for runner in self.manager.versions(name).values()}
        for runner, decoder in list(self._decoders.items()):
            if id(runner) not in served and decoder.rows == 0:
                del self._decoders[runner]
                decoder.stop()
