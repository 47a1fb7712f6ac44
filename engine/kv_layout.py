"""Which layers' KV a block id holds: the hybrid layout of models with sliding-window layers.

A model whose layers all attend to the whole context (Llama, Qwen, Phi, Mixtral, ...) keeps one K/V
tensor pair per layer, and a block id is a block of every layer: ``page_layers == num_layers``, no
window groups. The layout is "hybrid" when a model has both sliding-window layers, which read only the
last ``window`` positions, and full-attention layers (Gemma 2: one of two; Gemma 3: one of six): then
the blocks a window layer no longer reads need not stay held, so window layers keep their KV apart
from the full layers' (vLLM's hybrid KV cache manager works the same way).

- The pool is ``page_layers`` = F tensor pairs (F: the number of full layers); a block id (a "page")
  holds one block of K/V in each of them. The full layers use the sequence's block table as before.
- The window layers come in ``num_window_groups`` = G = ceil(window layers / F) groups of F layers
  (the last one short when F does not divide them). Window group g has its own table per sequence,
  parallel to the block table: entry i is the page holding block i of the group's layers, or 0 (the
  null block) where the sequence no longer holds it. Window layer j of the model (in layer order) is
  in group ``j // F`` and uses pool tensor ``j % F``; full layer i (in layer order) uses tensor i.
- So a block of a sequence costs one page while it is outside every window and 1 + G pages while it is
  inside one (or is being computed); pages are one pool, shared by both uses. Where F does not divide
  the window layers, the last group's pages hold fewer layers than F and the rest of them is unused:
  inside the window a block costs F * (1 + G) layer-blocks against the plain layout's L (Gemma 3 1B:
  28 / 26, 27B: 70 / 62; 12B: even).
- Under pipeline parallelism the pages, block tables and window tables are those of the whole model
  (the scheduler's); each stage's pool holds only the tensor pairs its layers use (``pool_pairs``).

The rule for what a window layer reads (transformers' sliding-window mask): the query at position p sees
the keys at positions > p - window. A sequence that has computed ``s`` tokens will next query position
s, so it needs the window pages of blocks ``first_needed_block(s)`` onwards.
"""

from __future__ import annotations

from dataclasses import dataclass

# the architectures whose window layers the kernels implement per layer (engine.config's
# WINDOWED_ARCHITECTURES), with how their configs mark the window layers
_DEFAULT_PATTERN = {"Gemma2ForCausalLM": 2, "Gemma3ForCausalLM": 6}


def window_layer_flags(hf_config: dict) -> list[bool]:
    """Per layer, whether it is a sliding-window layer (Gemma 2 / 3 configs: ``layer_types``, or
    the older ``sliding_window_pattern``: every pattern-th layer is global)."""
    n = hf_config["num_hidden_layers"]
    types = hf_config.get("layer_types")
    if types is None:
        archs = hf_config.get("architectures") or []
        gemma3 = "Gemma3ForCausalLM" in archs
        pattern = hf_config.get("sliding_window_pattern", 6) if gemma3 else _DEFAULT_PATTERN.get(
            archs[0] if archs else "", 2)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    if len(types) != n or set(types) - {"sliding_attention", "full_attention"}:
        raise ValueError(f"layer_types must name sliding_attention or full_attention for each of the {n} layers, "
                         f"got {types}")
    return [t == "sliding_attention" for t in types]


@dataclass(frozen=True)
class KVLayout:
    """``window_layers``: the layers whose blocks are released once behind the window (empty: the plain
    layout, one tensor pair per layer). ``window``: the tokens those layers see."""

    num_layers: int
    window: int = 0
    window_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.window_layers:
            if self.window < 1:
                raise ValueError(f"a hybrid KV layout needs a window >= 1, got {self.window}")
            if len(self.window_layers) >= self.num_layers:
                raise ValueError("a hybrid KV layout needs at least one full-attention layer")
            if sorted(set(self.window_layers)) != list(self.window_layers) or not all(
                    0 <= i < self.num_layers for i in self.window_layers):
                raise ValueError(f"window layers must be distinct layer indices in order, got {self.window_layers}")

    @classmethod
    def plain(cls, num_layers: int) -> KVLayout:
        return cls(num_layers)

    @classmethod
    def for_model(cls, hf_config: dict, architecture: str, hybrid: bool, max_model_len: int | None = None) -> KVLayout:
        """The layout the engine runs ``hf_config`` with: hybrid where the architecture's kernels honour
        per-layer windows, it has both kinds of layer, ``hybrid``, and a window shorter than
        ``max_model_len`` (else no block ever leaves a window: every layer is kept whole)."""
        n = hf_config["num_hidden_layers"]
        if not hybrid or architecture not in _DEFAULT_PATTERN:
            return cls.plain(n)
        window = int(hf_config.get("sliding_window") or 0)
        if max_model_len is not None and window >= max_model_len:
            return cls.plain(n)
        flags = window_layer_flags(hf_config)
        layers = tuple(i for i, w in enumerate(flags) if w)
        if window < 1 or not layers or len(layers) == n:
            return cls.plain(n)
        return cls(n, window, layers)

    @property
    def hybrid(self) -> bool:
        return bool(self.window_layers)

    @property
    def full_layers(self) -> tuple[int, ...]:
        window = set(self.window_layers)
        return tuple(i for i in range(self.num_layers) if i not in window)

    @property
    def page_layers(self) -> int:
        """Layers one block id holds K/V for: the pool's tensor pairs."""
        return len(self.full_layers) if self.hybrid else self.num_layers

    @property
    def num_window_groups(self) -> int:
        f = self.page_layers
        return -(-len(self.window_layers) // f) if self.hybrid else 0

    def placement(self, layer: int) -> tuple[int, int]:
        """(pool tensor pair, table) of ``layer``: table 0 is the sequence's block table, table g >= 1
        window group g - 1's table."""
        if not self.hybrid:
            return layer, 0
        if layer in self.window_layers:
            j = self.window_layers.index(layer)
            return j % self.page_layers, 1 + j // self.page_layers
        return self.full_layers.index(layer), 0

    def pool_pairs(self, start: int, end: int) -> tuple[int, ...]:
        """The pool tensor pairs that layers [start, end) use, in order: the pairs a pipeline stage of
        those layers holds (every pair for the whole model). Block ids (pages) mean the same on every
        stage, so a stage holds each page's K/V of these pairs only; a hybrid layout's window layers
        share the full layers' pairs (``placement``), so a stage of window layers only holds the pairs
        they map to."""
        return tuple(sorted({self.placement(layer)[0] for layer in range(start, end)}))

    def first_needed_block(self, num_computed: int, block_size: int) -> int:
        """The first block whose window pages a sequence that has computed ``num_computed`` tokens
        still reads (0 for a plain layout: every block)."""
        if not self.hybrid:
            return 0
        return max(0, num_computed - self.window + 1) // block_size

    def describe(self) -> str:
        if not self.hybrid:
            return f"every layer's KV kept whole ({self.num_layers} layers)"
        return (f"hybrid: {len(self.full_layers)} full-attention layers on the block table, "
                f"{len(self.window_layers)} sliding-window layers ({self.window} tokens) in "
                f"{self.num_window_groups} window group(s) whose blocks are released behind the window")
