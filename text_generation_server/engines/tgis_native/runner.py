"""The forward passes of the tgis_native engine: inputs in, logits out (the engine owns batches,
KV ownership and sampling; it calls this on the shard's worker thread).

Two ways in:

  forward(pieces, keep)   any step: each piece's new tokens packed into one batch [1, T], with
                          positions, soft-prompt embeddings and LoRA adapters; the step layout
                          built from Python lists (attention/layout.py StepLayout.build)
  decode(rows, ids)       a decode-only step, one token per row, through persistent buffers of
                          the largest step (DecodeBuffers): filled on the host, copied to the
                          device in one non-blocking copy, read in place by the model and the
                          attention backend.
With CUDA graphs (graphs.py) either kind of step, when no row uses a LoRA adapter or soft-prompt
embeddings and no prompt token's logits are asked for, goes through the same buffers with one
row per token (a prompt token at position p: a decode row of p + 1 keys) padded up to its
bucket, and replays that bucket's graph (padding rows write their K/V to the scratch slot and
have 0 keys); otherwise it runs eagerly (forward: over Python-built layouts; decode: over the
buffers).

On CPU, a step of either kind runs the decoder stack in one C++ call where the model allows it
(cpu_decoder.py), instead of the model's modules; LoRA adapters ride in the call where the step
has few adapter tokens (decode steps), else the step runs the modules.

Neither path reads a tensor back to the host: the step's only device-to-host copy is the
chosen ids (engines/step.py). Forward time is read from CUDA events after that copy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from text_generation_server.attention.backend import AttentionBackend, DecodeRows
from text_generation_server.attention.layout import Piece, StepLayout, piece_slots
from text_generation_server.engines.step import ForwardTimer
from text_generation_server.engines.tgis_native.cpu_decoder import NO_LORA, CpuDecoder, LoraArgs
from text_generation_server.kv.paged_kv import PagedKVCache, SequenceKV
from text_generation_server.utils.transfer import to_device

if TYPE_CHECKING:
    from text_generation_server.adapters import AdapterSet
    from text_generation_server.engines.tgis_native.graphs import StepGraphs
    from text_generation_server.lora import LoraWeights


@dataclass(slots=True)
class StepPiece:
    """One sequence's new tokens in a step."""

    kv: SequenceKV
    tokens: list[int]
    embeddings: torch.Tensor | None = None  # soft-prompt embeddings of its first tokens
    lora: LoraWeights | None = None


FIELDS = 5  # ids | positions | slots | lengths | kept


class DecodeBuffers:
    """The inputs of a step of up to `max_rows` rows (one token each), at fixed addresses.

        int64 [5 * max_rows + max_rows * width]:  ids | positions | slots | lengths | kept | tables

    `kept` lists the rows whose logits a graph returns (the rows the step chooses from). A
    host copy is filled by `fill` / `fill_pieces`; `upload` copies the used prefix to the
    device copy in one non-blocking copy. On CUDA two pinned host copies are taken in turn
    (a step may be filled while the upload of the one before still waits in the stream behind
    the forward before it: PIPELINE_STEPS); on CPU the one copy is the device copy.
    Padding rows (up to a graph's bucket): id 0, position 0, the scratch slot, 0 keys.
    """

    def __init__(self, max_rows: int, width: int, device: torch.device, scratch_slot: int) -> None:
        self.max_rows, self.width, self.scratch_slot = max_rows, width, scratch_slot
        size = FIELDS * max_rows + max_rows * width
        if device.type == "cpu":
            self.device_copy = torch.zeros(size, dtype=torch.long)
            hosts = [self.device_copy]
        else:  # two, taken in turn: a step is filled while the copy of the one before may be queued
            self.device_copy = torch.zeros(size, dtype=torch.long, device=device)
            hosts = [torch.zeros(size, dtype=torch.long, pin_memory=True) for _ in range(2)]
        self._hosts = [(host, host.numpy()) for host in hosts]
        self._copied: list[Any] = [None] * len(hosts)  # per host copy: its last upload's event
        self._turn = 0
        self._take(0)

    def _take(self, turn: int) -> None:
        """Write the next step into host copy `turn`, once its last upload has run."""
        self._turn = turn
        if (copied := self._copied[turn]) is not None:
            copied.synchronize()
        self.host, self._np = self._hosts[turn]
        self._np_tables = self._np[FIELDS * self.max_rows :].reshape(self.max_rows, self.width)

    def _next_host(self) -> None:
        if len(self._hosts) > 1:
            self._take(1 - self._turn)

    def _field(self, index: int, rows: int) -> torch.Tensor:
        start = index * self.max_rows
        return self.device_copy[start : start + rows]

    def ids(self, rows: int) -> torch.Tensor:
        return self._field(0, rows)

    def positions(self, rows: int) -> torch.Tensor:
        return self._field(1, rows)

    def slots(self, rows: int) -> torch.Tensor:
        return self._field(2, rows)

    def lengths(self, rows: int) -> torch.Tensor:
        return self._field(3, rows)

    def kept(self, rows: int) -> torch.Tensor:
        return self._field(4, rows)

    def tables(self, rows: int) -> torch.Tensor:
        start = FIELDS * self.max_rows
        return self.device_copy[start : start + rows * self.width].view(rows, self.width)

    def fill(self, sequences: Sequence[SequenceKV], ids: Sequence[int], rows: int) -> tuple[int, int]:
        """Write one new token per sequence (`ids`, at its next position), its blocks reserved
        and its length advanced; rows past len(sequences), up to `rows`, are padding.
        Returns the longest and shortest key counts of the real rows."""
        self._next_host()
        count, m = len(sequences), self.max_rows
        positions, slots = [], []
        for row, sequence in enumerate(sequences):
            position = sequence.append(1)
            positions.append(position)
            slots.append(sequence.slot(position))
            self._np_tables[row, : len(sequence.blocks)] = sequence.blocks
        host = self._np
        host[0:count] = ids
        host[m : m + count] = positions
        host[2 * m : 2 * m + count] = slots
        host[3 * m : 3 * m + count] = positions
        host[3 * m : 3 * m + count] += 1
        host[4 * m : 4 * m + count] = range(count)
        self.pad(count, rows)
        return max(positions) + 1, min(positions) + 1

    def fill_pieces(self, pieces: Sequence[StepPiece], kept: Sequence[int], rows: int) -> None:
        """Write every piece's new tokens as rows (in order: a row per token, its sequence's
        table, position p with p + 1 keys; the sequences' lengths advance) and `kept`, the
        rows whose logits are wanted; rows past the tokens, up to `rows`, are padding."""
        self._next_host()
        host, m, start = self._np, self.max_rows, 0
        for piece in pieces:
            sequence, count = piece.kv, len(piece.tokens)
            begin = sequence.append(count)
            end = start + count
            host[start:end] = piece.tokens
            host[m + start : m + end] = range(begin, begin + count)
            host[2 * m + start : 2 * m + end] = piece_slots(
                sequence.blocks, begin, begin + count, sequence.pool.block_size
            )
            host[3 * m + start : 3 * m + end] = range(begin + 1, begin + count + 1)
            self._np_tables[start:end, : len(sequence.blocks)] = sequence.blocks
            start = end
        self.pad(start, rows)
        host[4 * m : 4 * m + rows] = 0  # a graph returns kept(bucket) rows: the rest read row 0
        host[4 * m : 4 * m + len(kept)] = kept

    def pad(self, start: int, end: int) -> None:
        """Rows [start, end) become padding rows."""
        if end <= start:
            return
        host, m = self._np, self.max_rows
        host[start:end] = 0
        host[m + start : m + end] = 0
        host[2 * m + start : 2 * m + end] = self.scratch_slot
        host[3 * m + start : 3 * m + end] = 0
        host[4 * m + start : 4 * m + end] = 0  # a graph returns kept(bucket) rows: the rest read row 0

    def upload(self, rows: int, from_device: Sequence[FromDevice] = ()) -> None:
        """Copy the filled rows to the device; then rows whose id a step launched before this
        one chose on the device and is not read back (`from_device`: (row, that step's ids,
        its row there)) take it from there."""
        if self.device_copy is not self.host:
            used = FIELDS * self.max_rows + rows * self.width
            self.device_copy[:used].copy_(self.host[:used], non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
            self._copied[self._turn] = copied
        place_ids(self.ids(rows), from_device)


FromDevice = tuple[int, torch.Tensor, int]  # (row, ids on the device, index there)


def place_ids(target: torch.Tensor, from_device: Sequence[FromDevice]) -> None:
    """target[row] = ids[index] for each (row, ids, index), one copy per source tensor: a
    contiguous run (the common case: the same batch, stepped again) without index tensors."""
    groups: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}
    for row, ids, index in from_device:
        group = groups.setdefault(id(ids), (ids, [], []))
        group[1].append(row)
        group[2].append(index)
    for ids, rows, indices in groups.values():
        count = len(rows)
        if rows == list(range(rows[0], rows[0] + count)) and indices == list(
            range(indices[0], indices[0] + count)
        ):
            target[rows[0] : rows[0] + count].copy_(ids[indices[0] : indices[0] + count])
        else:
            device = target.device
            target.index_copy_(0, to_device(rows, device), ids.index_select(0, to_device(indices, device)))


class ModelRunner:
    def __init__(
        self,
        model: Any,
        cache: PagedKVCache,
        backend: AttentionBackend,
        window: int | None,
        accepts_logits_to_keep: bool,
        max_rows: int,
        max_length: int,
    ) -> None:
        self.model = model
        self.cache = cache
        self.backend = backend
        self.window = window
        self.device = cache.device
        self.dtype: torch.dtype = model.dtype
        self.accepts_logits_to_keep = accepts_logits_to_keep
        self.adapters: AdapterSet | None = None  # set by the engine once loaded (not in the probe step)
        self.graphs: StepGraphs | None = None  # set by the engine where graphs are captured
        self.decoder: CpuDecoder | None = None  # set by the engine where the C++ CPU step serves
        self.width = -(-max_length // cache.pool.block_size) + 1
        self.buffers = self._new_buffers(max_rows)
        self._overflow: DecodeBuffers | None = None  # steps larger than MAX_BATCH_SIZE (tests)
        self.timer = ForwardTimer(self.device)
        self.capturing = False  # keep the LM head's input of every forward (capture_hidden)
        self.hidden: torch.Tensor | None = None
        self._step_hidden: dict[int, torch.Tensor] = {}  # per decode_step size: its LM head's input

    def capture_hidden(self) -> None:
        """From now on keep the LM head's input of every forward in `hidden` [rows, hidden size]:
        the final hidden states of the rows whose logits the forward returns, in their order
        (an MLP speculator reads them). A replayed decode graph does not run the hook: the input
        its capture saw is its own tensor, rewritten by every replay, and stands in for it."""
        if self.capturing:
            return

        def keep(module: Any, args: tuple[torch.Tensor, ...]) -> None:
            self.hidden = args[0].reshape(-1, args[0].shape[-1])

        self.model.get_output_embeddings().register_forward_pre_hook(keep)
        self.capturing = True

    # ---- any step -------------------------------------------------------------------------------

    def forward(
        self, pieces: Sequence[StepPiece], keep: list[int] | None, from_device: Sequence[FromDevice] = ()
    ) -> torch.Tensor:
        """Write and attend `pieces`; logits [len(keep), vocab] (every packed token when keep is
        None). The sequences' lengths advance by their new tokens. `from_device`: packed
        tokens whose id is still on the device (DecodeBuffers.upload)."""
        if self.graphs is not None and keep is not None:
            bucket = self._piece_bucket(self.graphs, pieces, len(keep))
            if bucket is not None:
                return self._replay_pieces(bucket, pieces, keep, from_device)
        ids: list[int] = []
        positions: list[int] = []
        parts: list[Piece] = []
        virtual: list[tuple[int, torch.Tensor]] = []  # (packed index, embeddings from there)
        for piece in pieces:
            sequence, tokens = piece.kv, piece.tokens
            if piece.embeddings is not None:
                virtual.append((len(ids), piece.embeddings))
            begin = sequence.append(len(tokens))
            ids += tokens
            positions += range(begin, begin + len(tokens))
            parts.append(Piece(sequence.blocks, begin, len(tokens)))
        device = self.device
        layout = StepLayout.build(self.cache, self.backend, parts, self.window, self.dtype, device)
        if keep is not None and len(keep) == len(ids) and keep[-1] == len(ids) - 1:
            keep = None  # every packed token, in order
        loras = [p.lora for p in pieces]
        lengths = [len(p.tokens) for p in pieces]
        lora = self._layers_lora(loras, lengths)
        if self.decoder is not None and lora is not None:
            return self._forward_layers(
                self.decoder, ids, positions, virtual, layout, keep, lora, from_device
            )
        kwargs: dict[str, Any] = {}
        selected = keep is not None and self.accepts_logits_to_keep
        if selected and keep is not None:
            kwargs["logits_to_keep"] = to_device(keep, device, torch.long)
        packed = to_device([ids], device)
        place_ids(packed[0], from_device)
        if virtual:
            embeds = self.model.get_input_embeddings()(packed)
            for at, embeddings in virtual:
                embeds[0, at : at + embeddings.shape[0]] = embeddings
            kwargs["inputs_embeds"] = embeds
        else:
            kwargs["input_ids"] = packed
        applied = self._adapters(loras, lengths)
        self.timer.start()
        with applied:
            out = self.model(
                position_ids=to_device([positions], device),
                use_cache=False,
                tgis_step=layout,
                **kwargs,
            )
        logits = out.logits[0]
        if keep is not None and not selected:
            logits = logits[keep]
            if self.capturing and self.hidden is not None:
                self.hidden = self.hidden[keep]
        self.timer.stop()
        return logits

    def _piece_bucket(self, graphs: StepGraphs, pieces: Sequence[StepPiece], kept: int) -> int | None:
        """The graph that can take this step (None: run it eagerly): no LoRA rows or soft-prompt
        embeddings, no hidden states kept for a speculator (a graph keeps those of decode
        steps only), prompt rows that read few enough keys (graphs.py), and a bucket holding
        its tokens."""
        if self.capturing or any(p.lora is not None or p.embeddings is not None for p in pieces):
            return None
        keys = 0
        for piece in pieces:
            if (count := len(piece.tokens)) > 1:  # rows p = c + 1 .. c + n read p keys each
                keys += count * piece.kv.length + count * (count + 1) // 2
        return graphs.bucket_for(sum(len(p.tokens) for p in pieces), kept, keys)

    def _replay_pieces(
        self, bucket: int, pieces: Sequence[StepPiece], keep: list[int], from_device: Sequence[FromDevice]
    ) -> torch.Tensor:
        assert self.graphs is not None
        buffers = self.buffers
        buffers.fill_pieces(pieces, keep, bucket)
        buffers.upload(bucket, from_device)
        self.timer.start()
        logits = self.graphs.replay(bucket)[: len(keep)]
        self.timer.stop()
        return logits

    def _forward_layers(
        self,
        decoder: CpuDecoder,
        ids: list[int],
        positions: list[int],
        virtual: list[tuple[int, torch.Tensor]],
        layout: StepLayout,
        keep: list[int] | None,
        lora: LoraArgs,
        from_device: Sequence[FromDevice],
    ) -> torch.Tensor:
        """`forward` through the C++ decoder stack (cpu_decoder.py)."""
        packed = torch.tensor(ids)
        place_ids(packed, from_device)
        embeddings = decoder.embed(packed)
        for at, rows in virtual:
            embeddings[at : at + rows.shape[0]] = rows
        kept = None if keep is None else torch.tensor(keep, dtype=torch.long)
        self.timer.start()
        logits = decoder.forward(embeddings, torch.tensor(positions), layout, kept, lora)
        self.timer.stop()
        return logits

    def _layers_lora(self, loras: Sequence[LoraWeights | None], repeats: Sequence[int]) -> LoraArgs | None:
        """What the C++ decoder stack needs of the step's LoRA adapters; None where it cannot
        take the step (no decoder, or adapters it leaves to the modules)."""
        if self.decoder is None:
            return None
        if not any(loras):
            return NO_LORA
        lora = self.adapters.lora if self.adapters is not None else None
        return self.decoder.lora_for(loras, repeats, lora is not None and lora.kernel)

    def _adapters(
        self, loras: Sequence[LoraWeights | None], lengths: Sequence[int]
    ) -> contextlib.AbstractContextManager[None]:
        if self.adapters is None:
            return contextlib.nullcontext()
        return self.adapters.applied(loras, self.device, False, lengths)

    # ---- decode-only steps ------------------------------------------------------------------------

    def decode(
        self,
        sequences: Sequence[SequenceKV],
        ids: Sequence[int],
        loras: Sequence[LoraWeights | None],
        from_device: Sequence[FromDevice] = (),
    ) -> torch.Tensor:
        """One token per row (`ids` [D], each at its sequence's next position; `from_device`:
        rows whose id is still on the device) -> logits [D, vocab]."""
        count = len(sequences)
        graphs = self.graphs
        bucket = graphs.bucket_for(count, count) if graphs is not None and not any(loras) else None
        rows = bucket or count
        buffers = self._buffers_for(rows)
        longest, shortest = buffers.fill(sequences, ids, rows)
        buffers.upload(rows, from_device)
        self.timer.start()
        if bucket is not None:
            assert graphs is not None
            logits = graphs.replay(bucket)[:count]
            if self.capturing:
                self.hidden = self._step_hidden[bucket][:count]
        elif self.decoder is not None and (lora := self._layers_lora(loras, [1] * count)) is not None:
            b = buffers
            logits = self.decoder.decode(
                b.ids(rows), b.positions(rows), b.slots(rows), b.tables(rows), b.lengths(rows), lora
            )
        else:
            with self._adapters(loras, [1] * count):
                logits = self.decode_step(rows, longest, shortest, buffers)()
        self.timer.stop()
        return logits

    def _new_buffers(self, rows: int) -> DecodeBuffers:
        return DecodeBuffers(rows, self.width, self.device, self.cache.scratch_slot)

    def hold(self, rows: int) -> None:
        """Make the persistent buffers hold steps of `rows` rows (the largest graph's)."""
        if self.buffers.max_rows < rows:
            self.buffers = self._new_buffers(rows)

    def _buffers_for(self, rows: int) -> DecodeBuffers:
        """The persistent buffers (graphs read them), or for a step of more rows than they hold
        (a BatchManager allowing more than this engine's MAX_BATCH_SIZE) buffers of its own."""
        if rows <= self.buffers.max_rows:
            return self.buffers
        if self._overflow is None or self._overflow.max_rows < rows:
            self._overflow = self._new_buffers(rows)
        return self._overflow

    def decode_step(
        self,
        rows: int,
        longest: int,
        shortest: int,
        buffers: DecodeBuffers | None = None,
        kept: int | None = None,
    ) -> Callable[[], torch.Tensor]:
        """The forward of `rows` rows of one token each over the buffers as they will be when it
        is called: a closure over fixed views and a fixed layout (what a CUDA graph captures).
        With `kept`, the logits of the first `kept` rows the buffers' kept field names (else of
        every row). `longest` / `shortest` key counts matter only to backends that are not
        graphable."""
        b = buffers or self.buffers
        rows_view = DecodeRows(
            slice(0, rows), b.tables(rows), b.lengths(rows), longest, shortest, self.window
        )
        layout = StepLayout.decode_only(self.cache, self.backend, rows_view, b.slots(rows), self.dtype)
        input_ids, position_ids = b.ids(rows).unsqueeze(0), b.positions(rows).unsqueeze(0)
        chosen = b.kept(kept) if kept is not None else None
        selected = chosen is not None and self.accepts_logits_to_keep
        extra = {"logits_to_keep": chosen} if selected else {}

        def step() -> torch.Tensor:
            out = self.model(
                input_ids=input_ids, position_ids=position_ids, use_cache=False, tgis_step=layout, **extra
            )
            logits: torch.Tensor = out.logits[0]
            if chosen is not None and not selected:
                logits = logits.index_select(0, chosen)
            if self.capturing and self.hidden is not None:
                self._step_hidden[rows] = self.hidden  # captured: the graph's own tensor
            return logits

        return step
