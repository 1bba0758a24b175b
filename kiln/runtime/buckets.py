"""Shape buckets: pad a run's inputs up to a few sizes per dynamic dim, so that a stream of
arbitrary shapes replays a bounded number of CUDA graphs (one per bucket, not one per shape).

Padding must never change a result. It is exact along a dim when every output element that is
kept (the crop back to the real size) is computed from real elements only:

    batch   rows of a batch never meet (inference normalisation, attention and GEMMs are per row):
            every symbol that is axis 0 of every input and output carrying it
    seq     where the model masks padding: an integer/bool input named like `attention_mask`,
            shaped [batch, seq], gets zeros in the padded positions, so attention never reads them;
            or where the user declares it (`pad_dims`, e.g. a causal decoder padded at the end)

A dim is padded only when every output carrying it carries it as a plain symbol (so it can be
cropped); padded values are zeros. Bucket sizes are powers of two from a floor (1 for batch, 16
for sequences) up to the profile's max, which is always a bucket. Large sizes are where padding
costs compute, so a sequence also has a 1.5x step from 128 and quarter steps from 256 (256, 320,
384, 448, 512, 640, ...: at most 1.25x padding there). A batch between two powers of two is not
padded by up to 2x when splitting it costs less: its rows run as several bucket-sized chunks
(25 = 16 + 8 + 1), each a graph replay, chosen by the replay times each bucket's capture measured
(`split`). BERT with batch 1..32 x seq 1..512: 6 x 10 = 60 buckets.

A context may ask for batch buckets with a 1.5x step between powers of two from HALF_BATCH_FROM (`batch_steps`
"half": 1, 2, 4, 8, 12, 16, 24, 32, 48, 64, ...): a served call of ~12 merged requests then replays the 12 bucket,
not 16 (a quarter of its GPU time is padding there), and the split still picks the cheapest cover by the measured
replays. It costs graphs: 8 x 10 = 80 buckets for 1..32 x 1..512 (past MAX_GRAPHS, 64: a stream over the whole
profile would evict), 10 x 4 = 40 for 1..64 x 128 (pow2: 28), so it is a choice ("pow2" by default; kiln serve's
batch_buckets parameter, --batch-buckets), not the rule.

A padding-free engine (kiln/passes/remove_padding.py) computes only its packed rows, so padding the batch and the
sequence costs it the few layers before the packing: where CUDA graphs replay, a run of 2K+ bucketed positions is
padded to the profile's largest shape and packed to its token bucket (graph_rows), one graph per token bucket,
and smaller runs take the plain program at their bucket (a packed run pays the largest shape's fixed cost, which
a run that small cannot save): 39 + 24 + 1 = 64 graphs for 1..32 x 1..512.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kiln.plan.spec import MASK_NAMES, Binding, Profile

SEQUENCE_FLOOR = 16
HALF_BATCH_FROM = 8  # batch_steps "half": a 1.5x step between powers of two from here (12, 24, 48, ...)
BATCH_STEPS = ("pow2", "half")  # a batch's buckets: powers of two only, or with the 1.5x steps from HALF_BATCH_FROM
HALF_STEP_FROM = 128  # sequences: a 1.5x step between powers of two from here
QUARTER_STEPS_FROM = 256  # sequences: steps of a quarter of the power of two from here
MAX_CHUNKS = 4  # a split batch runs as at most this many replays
CHUNK_OVERHEAD_MS = 0.02  # per extra replay: slicing, padding and the outputs' copy
SPLIT_MARGIN = 0.05  # split only when the chunks' measured time is this much below the padded run's


@dataclass
class Buckets:
    """Which (input, axis) and (output, axis) pairs carry each padded symbol."""

    symbols: dict[str, int]  # symbol -> smallest bucket
    pads: list[list[tuple[int, str]]]  # per input: [(axis, symbol)]
    crops: list[list[tuple[int, str]]]  # per output: [(axis, symbol)]
    batch: str | None = None  # the symbol a run may split into chunks: axis 0 of every input and output carrying it
    # measured ms of one replay per bucket: {other symbols' (symbol, bucket) pairs: {batch bucket: ms}}
    costs: dict[tuple, dict[int, float]] = field(default_factory=dict)
    _splits: dict[tuple, list[tuple[int, int]] | None] = field(default_factory=dict)  # split()'s answers
    batch_steps: str = "pow2"  # BATCH_STEPS: the buckets of a batch (a symbol of floor 1)

    def sizes(self, symbol: str, low: int, high: int) -> list[int]:
        """The buckets of `symbol` inside [low, high]: powers of two from the floor (sequences with
        a 1.5x step from HALF_STEP_FROM and quarter steps from QUARTER_STEPS_FROM; a batch with a 1.5x step
        from HALF_BATCH_FROM where batch_steps is "half"), and high."""
        floor = max(self.symbols[symbol], 1)
        half_from = HALF_STEP_FROM if floor > 1 else HALF_BATCH_FROM if self.batch_steps == "half" else None
        return [s for s in _ladder(floor, high, sequence=floor > 1, half_from=half_from) if s >= low] + [high]

    def bucket(self, symbol: str, value: int, low: int, high: int) -> int:
        return next(s for s in self.sizes(symbol, low, high) if s >= value)

    def targets(self, inputs: list[torch.Tensor], profile: Profile, names: list[str],
                widest: bool = False) -> dict[str, tuple[int, int]]:
        """symbol -> (real size, bucket size) for this run, inside `profile`'s range; `widest`: the bucket is the
        profile's largest size (a packed run's, graph_rows)."""
        out: dict[str, tuple[int, int]] = {}
        for k, pads in enumerate(self.pads):
            r = profile.inputs.get(names[k])
            for axis, symbol in pads:
                if symbol in out or r is None:
                    continue
                value = int(inputs[k].shape[axis])
                out[symbol] = (value, r.max[axis] if widest else self.bucket(symbol, value, r.min[axis], r.max[axis]))
        return out

    def _rest(self, targets: dict[str, tuple[int, int]]) -> tuple:
        return tuple(sorted((s, b) for s, (_, b) in targets.items() if s != self.batch))

    def learn(self, targets: dict[str, tuple[int, int]], ms: float | None) -> None:
        """Record one replay's time of the bucket `targets` pads to (the graph capture measured it)."""
        if ms is not None and self.batch is not None and self.batch in targets:
            self.costs.setdefault(self._rest(targets), {})[targets[self.batch][1]] = ms
            self._splits.clear()

    def split(self, targets: dict[str, tuple[int, int]]) -> list[tuple[int, int]] | None:
        """[(rows, batch bucket)] to run the batch as chunks, or None to run it padded as one.

        Chunks are taken from the buckets whose replay time is known at the run's other sizes; the
        fewest-milliseconds cover of the real rows (at most MAX_CHUNKS replays, CHUNK_OVERHEAD_MS each
        beyond the first) wins when it is SPLIT_MARGIN below the padded bucket's own time:
        25 rows as 16 + 8 + 1 instead of 32 where the GPU's time grows with the rows."""
        if self.batch is None or self.batch not in targets:
            return None
        key = (targets[self.batch], self._rest(targets))
        if key not in self._splits:
            if len(self._splits) >= 4096:
                self._splits.clear()
            self._splits[key] = self._cheapest_split(targets)
        return self._splits[key]

    def _cheapest_split(self, targets: dict[str, tuple[int, int]]) -> list[tuple[int, int]] | None:
        real, padded = targets[self.batch]
        known = self.costs.get(self._rest(targets), {})
        whole = known.get(padded)
        if real == padded or whole is None or len(known) < 2:
            return None
        # best[n]: (ms, chunks) covering n rows with at most MAX_CHUNKS chunks, largest chunks first
        best: list[tuple[float, tuple[tuple[int, int], ...]]] = [(0.0, ())]
        for n in range(1, real + 1):
            options = []
            for size, ms in known.items():
                rows = min(size, n)
                before_ms, before = best[n - rows]
                if len(before) < MAX_CHUNKS:
                    options.append((before_ms + ms + (CHUNK_OVERHEAD_MS if before else 0.0), before + ((rows, size),)))
            best.append(min(options) if options else (float("inf"), ()))
        ms, chunks = best[real]
        if len(chunks) < 2 or ms >= whole * (1 - SPLIT_MARGIN):
            return None
        return sorted(chunks, key=lambda c: -c[1])

    def pad(self, inputs: list[torch.Tensor], targets: dict[str, tuple[int, int]]) -> list[torch.Tensor]:
        """Inputs zero-padded at the end of each padded dim to their buckets (unchanged where they already are
        there). One constant-pad op per input: a run's host time is much of a small bucket's latency, and zeros
        then a copy into a slice cost two launches, an indexing call and its views."""
        padded = []
        for x, pads in zip(inputs, self.pads):
            widths = [0] * (2 * x.dim())  # F.pad's order: (last dim's before, after, the one before it's, ...)
            for axis, symbol in pads:
                widths[2 * (x.dim() - 1 - axis) + 1] = targets[symbol][1] - x.shape[axis]
            padded.append(F.pad(x, widths) if any(widths) else x)
        return padded

    def padded_shapes(self, inputs: list[torch.Tensor], targets: dict[str, tuple[int, int]]) -> list[tuple[int, ...]]:
        """The shape of each input as pad() would make it."""
        shapes = []
        for x, pads in zip(inputs, self.pads):
            shape = list(x.shape)
            for axis, symbol in pads:
                shape[axis] = targets[symbol][1]
            shapes.append(tuple(shape))
        return shapes

    def crop(self, outputs: list, targets: dict[str, tuple[int, int]]) -> list:
        cropped = []
        for y, crops in zip(outputs, self.crops):
            if crops and isinstance(y, torch.Tensor):
                index = [slice(None)] * y.dim()
                for axis, symbol in crops:
                    index[axis] = slice(0, targets[symbol][0])
                y = y[tuple(index)]
            cropped.append(y)
        return cropped


def pad_to(x: torch.Tensor, out: torch.Tensor) -> None:
    """x written into `out`'s leading corner, zeros after it along every dim where `out` is larger: what pad() then
    a copy into `out` give, without the padded tensor in between (a CUDA graph's static input, kiln/runtime/
    cuda_graphs.py _Captured.fill)."""
    out.zero_()
    out[tuple(slice(0, n) for n in x.shape)].copy_(x)


def _ladder(floor: int, high: int, sequence: bool, half_from: int | None = HALF_STEP_FROM) -> list[int]:
    """Bucket sizes below `high`: powers of two from `floor`, with a 1.5x step from `half_from` (None: none); a
    sequence's also quarter steps from QUARTER_STEPS_FROM."""
    ladder, size = [], floor
    while size < high:
        ladder.append(size)
        if sequence and size >= QUARTER_STEPS_FROM:
            ladder += [size + k * size // 4 for k in (1, 2, 3) if size + k * size // 4 < high]
        elif half_from is not None and size >= half_from and size * 3 // 2 < high:
            ladder.append(size * 3 // 2)
        size *= 2
    return ladder


TOKEN_EIGHTHS_FROM = 1024  # token buckets: steps of an eighth of the power of two from here


@dataclass(frozen=True)
class PackingRule:
    """Where a device's padding-free runs pack their real tokens (kiln/ops/tokens.py) and to how many rows.

    min_saving: (positions B·S at least, the fraction of them a packed run must save); below the smallest, and
    below the fraction, a run takes the identity packing (every position a row: the plain engine's computation).
    eighths_from: token buckets step by an eighth of the power of two from here (token_bucket).
    always_bucketed: a run's rows are its token bucket even where the context does not bucket shapes.
    graphs_from: where a context replays CUDA graphs of bucketed shapes, a run whose bucketed B·S is at least this
    always packs, padded to the profile's largest shape, into at least rows_from rows (graph_rows): its graph is
    then one per token bucket, not one per padded batch x sequence x token bucket. A smaller run takes the plain
    program at its bucket. graph_eighths_from: eighths_from for those token buckets (fewer graphs where a GEMM's
    time grows slowly with its rows)."""

    min_saving: tuple[tuple[int, float], ...]
    eighths_from: int = TOKEN_EIGHTHS_FROM
    always_bucketed: bool = False
    graphs_from: int | None = None  # graph_rows: where a context replays CUDA graphs (None: the min_saving rule)
    rows_from: int = 0  # graph_rows: the fewest rows a packed graph computes
    graph_eighths_from: int = TOKEN_EIGHTHS_FROM


PACKING_RULES = {
    # H200 (BERT-base fp16, bench/remove_padding.py at 18a3d98): packed runs saving 12-25% of 1K-4K positions were
    # 4-20% slower than the plain engine, 15% of 16K positions 7% faster, 59% of 16K 1.9x faster. Its rows are
    # bucketed where CUDA graphs bucket shapes.
    # With CUDA graphs (graph_rows): bench/dynamic.py's stream (200 requests, 1-32 x 1-512, seed 0) meets 121
    # distinct (batch bucket, sequence bucket, token bucket) signatures under the rule above, each a capture, past
    # the 64-graph cache; packing every run of 1K+ positions at the profile's largest shape meets 45 (of 63 at
    # most), and "always packed" was as fast as the rule's choice at every 1K+ shape measured
    # (padding-free-plain-2026-12-02.md run 2: 8x128 0.781 vs 0.789 ms, 32x128 1.673 vs 1.824, 8x512 1.834 vs
    # 1.990, 32x512 full 7.214 vs 7.242).
    # A packed run pads to the profile's largest shape, which costs it a fixed amount: 8x128 took 1.385 ms packed
    # at 32x512 where the plain program at its bucket took 0.79 (dynamic-cuda-2026-12-03.md), as much as the GEMMs
    # of ~2K rows: a run of fewer bucketed positions cannot save it, so it runs plain at its bucket (graphs_from).
    # Packed graphs compute at least 1K rows (below, a GEMM's time hardly depends on its rows), in quarter steps up
    # to 4K rows and eighths above (graph_eighths_from): 39 plain buckets below 2K positions + 24 token buckets +
    # the plain 32x512 = 64 graphs for 1..32 x 1..512, MAX_GRAPHS (kiln/runtime/cuda_graphs.py).
    "cuda": PackingRule(((16384, 0.10), (4096, 0.30), (1024, 0.45)), graphs_from=2048, rows_from=1024,
                        graph_eighths_from=4096),
    # CPU (AMD EPYC 2 vCPUs, bert_tiny fp32 at 1x64, 4x128, 8x128; bench/results/remove-padding-cpu-2026-12-02.md):
    # packed runs were as fast or faster than the identity packing at every padding measured (6% to 50%; the
    # copies around the GEMMs are alike, the attention is varlen), so any row saved packs. The rows are always a
    # token bucket of eighth steps (at most 1/8 dummy rows): each new row count binds the native segment at its
    # sizes (a view: ~1-5 ms for bert_tiny), so a stream of masks binds at most 8 per power of two.
    "cpu": PackingRule(((1, 0.0),), eighths_from=SEQUENCE_FLOOR, always_bucketed=True),
}
PACK_MIN_SAVING = PACKING_RULES["cuda"].min_saving  # the H200's (kept by name: what `packing="auto"` says it follows)
PACKING = ("auto", "always", "never")  # an execution context's choice: the rule above, pack whenever a row is saved,
# or the identity packing always


def packing_rule(device: torch.device) -> PackingRule:
    """The device's rule (CUDA's for another accelerator: its numbers are the only ones measured there)."""
    return PACKING_RULES.get(device.type, PACKING_RULES["cuda"])


def token_bucket(tokens: int, most: int, eighths_from: int = TOKEN_EIGHTHS_FROM) -> int:
    """The packed rows a padding-free run computes for `tokens` real ones (kiln/passes/remove_padding.py): powers
    of two from SEQUENCE_FLOOR, a 1.5x step from HALF_STEP_FROM, quarter steps from QUARTER_STEPS_FROM and eighth
    steps from `eighths_from` (every packed row costs the GEMMs a row: at most 1.125x dummy rows where they
    cost most), capped at `most` (= B·S). A bucket is one CUDA graph per padded batch x sequence: finer steps
    would capture more of them."""
    size = SEQUENCE_FLOOR
    while size < most:
        parts = 8 if size >= eighths_from else 4 if size >= QUARTER_STEPS_FROM else 2 if size >= HALF_STEP_FROM \
            else 1
        for k in range(parts):
            if (bucket := size + k * size // parts) >= tokens:
                return min(bucket, most)
        size *= 2
    return most


def graph_rows(tokens: int, most: int, rule: PackingRule) -> int:
    """The rows a graph-replaying run packs `tokens` real tokens to, its inputs padded to the profile's largest
    shape of `most` positions (rule.graphs_from): their token bucket, at least rule.rows_from rows (below that a
    GEMM's time hardly depends on its rows, and every bucket less is a graph less); `most` where the bucket
    reaches it (the identity packing: the plain program at the largest shape). So the packed runs replay at most
    one graph per token bucket from rows_from to `most`: 25 for 1024 to 16384 on CUDA."""
    return max(token_bucket(tokens, most, rule.graph_eighths_from), min(rule.rows_from, most))


def graph_signatures(batches: list[int], sequences: list[int], most: int, rule: PackingRule) -> int:
    """How many CUDA graphs a padding-free context that packs by graph_rows may hold at most: one plain graph per
    batch x sequence bucket below rule.graphs_from positions, one packed graph per token bucket from rule.rows_from
    below `most`, and the plain one at the largest shape."""
    plain = sum(1 for b in batches for s in sequences if b * s < rule.graphs_from)
    return plain + len(graph_token_buckets(most, rule)) + 1


def graph_token_buckets(most: int, rule: PackingRule) -> list[int]:
    """The token buckets graph_rows packs to below `most` (the rows each packed graph computes)."""
    out, rows = [], min(rule.rows_from, most)
    while rows < most:
        out.append(rows)
        rows = token_bucket(rows + 1, most, rule.graph_eighths_from)
    return out


def saving_needed(positions: int, rule: PackingRule | None = None) -> float | None:
    """The fraction of `positions` a packed run must save to be run packed (the rule's min_saving, CUDA's unless
    given); None: never."""
    rule = rule or PACKING_RULES["cuda"]
    return next((saving for least, saving in rule.min_saving if positions >= least), None)


def packed_rows(mask: torch.Tensor, tokens: int | None, bucketed: bool, packing: str = "auto",
                positions: int | None = None, rule: PackingRule | None = None) -> int:
    """The rows a padding-free run packs this mask to: its real tokens (`bucketed`, or the rule's always_bucketed:
    their token bucket), or B·S, the identity packing, where packing would not pay (`packing` "auto": the mask's
    device's PackingRule, or `rule`) or is not wanted ("never"). `tokens`: the real tokens when the caller counted
    them on the host (a numpy mask); else counted here, which for a CUDA mask is the run's one synchronization with
    the host (not taken where the positions alone decide: "never", or "auto" below the rule's smallest).
    `positions`: B·S of the mask as the run pads it to its buckets, when it is not padded yet (its padding adds no
    token)."""
    rule = rule or packing_rule(mask.device)
    positions = mask.numel() if positions is None else positions
    need = saving_needed(positions, rule) if packing == "auto" else 0.0
    if packing == "never" or need is None:
        return positions
    tokens = int(torch.count_nonzero(mask)) if tokens is None else tokens
    rows = token_bucket(tokens, positions, rule.eighths_from) if bucketed or rule.always_bucketed else tokens
    return rows if positions - rows >= need * positions and rows < positions else positions


def plan_buckets(inputs: list[Binding], outputs: list[Binding], pad_dims: list[str] | None = None) -> Buckets | None:
    """The dims this engine may pad, or None when there is none (fixed shapes, or no dim where
    padding is exact). `pad_dims`: symbols the user declares exact to pad, besides batch and a
    masked sequence."""
    carriers: dict[str, list[tuple[str, int, int]]] = {}  # symbol -> [(input name, axis, rank)]
    for b in inputs:
        if b.kind != "tensor" or b.shape is None:
            continue
        for axis, d in enumerate(b.shape):
            if isinstance(d, str):
                carriers.setdefault(d, []).append((b.name, axis, len(b.shape)))
    floors: dict[str, int] = {}
    mask = next((b for b in inputs if b.kind == "tensor" and b.shape is not None and len(b.shape) == 2
                 and any(m in b.name.lower() for m in MASK_NAMES) and b.dtype in ("int64", "int32", "bool")
                 and all(isinstance(d, str) for d in b.shape)), None)
    for symbol, where in carriers.items():
        if all(axis == 0 for _, axis, _ in where):
            floors[symbol] = 1  # batch
        elif mask is not None and symbol == mask.shape[1] and all(axis == 1 for _, axis, _ in where):
            floors[symbol] = SEQUENCE_FLOOR  # the sequence the mask covers
        if pad_dims and symbol in pad_dims:
            floors.setdefault(symbol, SEQUENCE_FLOOR)
    # every output carrying a padded symbol must carry it as a croppable axis; unknown dims forbid
    for b in outputs:
        if b.kind != "tensor":
            floors.clear()
            break
        if b.shape is None:
            floors.clear()  # rank unknown: nothing can be cropped back
            break
        for d in b.shape:
            if d is None or (isinstance(d, str) and d not in carriers):
                floors.clear()  # unnamed, or an expression of symbols ("seq + 1"): it could not be cropped
    if not floors:
        return None
    pads = [[(axis, d) for axis, d in enumerate(b.shape or []) if d in floors] for b in inputs]
    crops = [[(axis, d) for axis, d in enumerate(b.shape or []) if d in floors] for b in outputs]
    # a batch splits into chunks when every output carries it at axis 0 (the chunks' rows concatenate)
    batches = [s for s, floor in floors.items() if floor == 1 and all((0, s) in c for c in crops)]
    return Buckets(floors, pads, crops, batch=batches[0] if len(batches) == 1 else None)
