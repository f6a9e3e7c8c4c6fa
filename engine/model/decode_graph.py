"""A model's layer stack compiled with torch.compile for one request's short queries.

On this project's CPUs a draft model's decode is only half weights: the 0.5B draft reads its
0.39 GiB of int8 weights in ~30 ms, then spends as long again in some 3,000 small ATen calls
(norms, rotary, attention, activation rounding) and the Python between them, and every draft
token of a speculative step pays for that. Inductor fuses those small ops into a few loops per
layer (fbgemm's GEMM stays an opaque call: `specserve::linear_dynamic`), which takes a draft
forward from 70 to 60 ms at one row and from 87 to 65 ms at four (docs/BENCHMARKS.md).

What is compiled, and when:
- Batches of one request with at most `SHORT_QUERY_MAX` new tokens: a draft's decode and its
  catch-up at low load, where speculation pays. Anything else (prefill, several requests) runs
  the eager layers: those shapes would need graphs of their own, each a minute or more of
  compiling on a 2-core host.
- Both graphs (one new token; several) are compiled at start (`warm_up`), with progress in the
  log. Inductor caches them on disk ($TORCHINDUCTOR_CACHE_DIR, by default under the specserve
  cache), so later starts take ~35 s here.
- After the warm-up no call may compile again: a batch the graphs do not cover (it should not
  happen) runs eagerly instead, as does everything once compiling fails (no C++ compiler, an
  op inductor cannot lower): one warning, never an error.

The graph is not bit-identical to the eager layers: inductor keeps bf16 intermediates in float32
where the eager ops round them, so logits differ by about what bf16 rounding does. Only a draft,
whose tokens the target verifies, is compiled (`draft_compile`): its numbers move acceptance,
never the output.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, cast

import torch
import torch.fx.experimental._config as fx_config
from torch import nn
from torch.utils._config_module import ConfigModule

from engine.model.attention import AttentionMetadata
from engine.model.bundled import cache_dir

if TYPE_CHECKING:
    from engine.model.decoder import DecoderModel, KVCache

# install_config_module made the module a ConfigModule (patch, ...); its type stub does not say so
shape_config = cast(ConfigModule, fx_config)

log = logging.getLogger("specserve.compile")
# Set on import, before anything asks inductor for its cache (it then fixes its /tmp default).
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))


# Layers per compiled call. One graph of all 24 layers of the 0.5B draft took 9 minutes to
# compile on the 2-core host; one of 6, called four times, 2.5 minutes, and runs as fast.
LAYERS_PER_GRAPH = 6


def _run_layers(
    layers: list[nn.Module],
    x: torch.Tensor,  # [num_tokens, hidden]
    rope: tuple[torch.Tensor, torch.Tensor],
    kv_caches: list[KVCache],
    meta: AttentionMetadata,
) -> torch.Tensor:  # [num_tokens, hidden]
    residual: torch.Tensor | None = None  # each chunk takes and returns the whole stream
    for layer, kv_cache in zip(layers, kv_caches, strict=True):
        x, residual = layer(x, residual, rope, kv_cache, meta)
    assert residual is not None
    return x.to(residual.dtype) + residual  # x: float32 from a GGUF GEMM, or the model dtype


class DecodeGraph:
    """Stands in for `DecoderModel.run_layers`: the compiled graph where it fits the batch."""

    def __init__(self, model: DecoderModel) -> None:
        self.model = model
        # one graph for every run of LAYERS_PER_GRAPH layers (they differ only in weights)
        self.graph = torch.compile(_run_layers, dynamic=True)
        layers = list(model.layers)
        self.chunks = [
            (start, layers[start : start + LAYERS_PER_GRAPH])
            for start in range(0, len(layers), LAYERS_PER_GRAPH)
        ]
        self.warm = False  # after warm_up: a call that would compile runs eagerly instead
        self.broken = False  # compiling failed: eager from now on
        self.calls = 0  # compiled calls (tests read it)

    @staticmethod
    def fits(meta: AttentionMetadata) -> bool:
        return meta.short_only and meta.groups[0].batch == 1

    def __call__(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        if self.broken or not self.fits(meta):
            return self.model.run_layers(x, rope, kv_caches, meta)
        try:
            with self._stance():
                out = x
                for start, layers in self.chunks:
                    kv = kv_caches[start : start + len(layers)]
                    out = self.graph(layers, out, rope, kv, meta)
        except RuntimeError as err:  # raised before a graph ran; the eager pass redoes all layers
            if not self.warm:
                self._give_up(err)
            else:
                log.warning("a decode batch the compiled graph does not cover ran eagerly: %s", err)
            return self.model.run_layers(x, rope, kv_caches, meta)
        self.calls += 1
        return self.model.norm(out)

    def warm_up(self, forward: Callable[[int], object]) -> None:
        """Compile the graphs for one new token and for several: `forward(n)` runs the runner's
        forward on n tokens of one request, so that the batches are built as they will be."""
        started = time.perf_counter()
        for num_tokens in (1, 2):
            log.info(
                "compiling the decode graph for %d new token%s (first start on a host: minutes; "
                "then cached in %s)",
                num_tokens,
                "" if num_tokens == 1 else "s",
                os.environ["TORCHINDUCTOR_CACHE_DIR"],
            )
            try:
                forward(num_tokens)
            except Exception as err:  # an inductor failure of any kind: run eagerly
                self._give_up(err)
            if self.broken:
                return
        self.warm = True
        log.info("decode graph ready in %.0f s", time.perf_counter() - started)

    def _stance(self) -> AbstractContextManager[object]:
        """Warm: no compiling (a new shape raises, and the batch runs eagerly). Warming up:
        compile without duck sizing."""
        if self.warm:
            return torch.compiler.set_stance("fail_on_recompile")
        # No duck sizing while compiling: a batch's block count must not share a symbol with
        # another size that happens to be equal (2 blocks and 2 KV heads), which specializes it.
        return shape_config.patch("use_duck_shape", False)

    def _give_up(self, err: Exception) -> None:
        self.broken = True
        log.warning(
            "torch.compile failed (%s: %s); the layers run eagerly", type(err).__name__, err
        )
