"""The training loop that every rank runs, with the public API only.

Each rank builds the GPT on the meta device and hands it to
``Zero3CpuOffloadManager.from_meta``, so no rank ever holds the whole model;
then every step runs ``forward_pass``, the loss outside the manager,
``backward_pass`` (with the learning rate, so layer updates start during
backward, and the micro-batch's valid label tokens, so the update follows the
global token mean) and ``optimizer_step``, once per micro-step. With ``--model
DIR`` the model is a transformers causal LM (see ``train.hf``) run in module
mode: each micro-step is ``forward(input_ids=x, labels=x)`` (transformers
computes the shifted loss), ``backward(out.loss, tokens=n)`` (``n``: the
labels it predicts) and ``optimizer_step``; ``--export`` ends
the run with ``save_pretrained``. Each text sequence depends only on ``(seed, step,
its position in the step's global batch)``, so a resumed run sees the data the
uninterrupted run would have seen, also on another number of ranks. With examples
(``--data`` of records or a dataset) the steps are those of ``train.sft_steps``: the
order depends on (seed, epoch, global position), and the position is saved in the
checkpoint.

A stop request (SIGINT/Ctrl-C or SIGTERM on any rank, or the launcher's stop
file) is agreed by all ranks at the end of a step, in the same all-reduce as
the loss, so every rank stops after the same step and saves one checkpoint.

Every ``_TRIM_EVERY`` steps a rank returns the free pages of its C heap to the
OS (``trim_heap``): freed blocks below the mmap threshold otherwise stay
resident, and RSS crept up by about 10 % over 2,000 steps of the default job
(``python benchmarks/run.py soak``).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import resource
import signal
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.nn.functional as F

from zero3_offload import logging as zlogging
from zero3_offload.checkpoint.format import read_metadata
from zero3_offload.config import Zero3CpuOffloadConfig
from zero3_offload.data.sft_data import SftData
from zero3_offload.data.source import find_source
from zero3_offload.errors import (
    CheckpointError,
    ConfigError,
    InputError,
    MemoryBudgetError,
    NonFiniteError,
    Zero3Error,
)
from zero3_offload.manager import Zero3CpuOffloadManager
from zero3_offload.memory.allocator import trim_heap
from zero3_offload.parameter.flat_layout import total_numel
from zero3_offload.testing import RankContext
from zero3_offload.train import hf
from zero3_offload.train.adapters import peft_config_of
from zero3_offload.train.corpus import VOCAB_SIZE, ByteCorpus
from zero3_offload.train.decay_split import trainer_param_groups
from zero3_offload.train.export import export_model
from zero3_offload.train.model import GPT, GPTShape
from zero3_offload.train.options import TrainOptions
from zero3_offload.train.progress import Reporter
from zero3_offload.train.resume_check import adapter_mismatch, adapter_options
from zero3_offload.train.sft_steps import SftSteps
from zero3_offload.train.sources import flagify
from zero3_offload.train.step_counts import StepCounts

__all__ = ["RankResult", "RunSettings", "TrainError", "learning_rate", "train_rank"]

log = zlogging.get_logger(__name__)

# Steps between two trims of the C heap (see the module docstring). A trim takes 2-3 ms, and
# the free pages the next steps use again fault back in (about 40 MiB per rank in the default
# job): every 50 steps that costs well under 1 % of the run.
_TRIM_EVERY = 50
_IGNORED = -100  # the label id cross-entropy (and transformers) leaves out of the loss


class TrainError(Zero3Error):
    """A user's mistake found inside a rank (e.g. resuming another model): one line."""


@attrs.frozen
class RunSettings:
    """Everything a rank needs (sent to each rank process, so it must pickle)."""

    train: TrainOptions
    zero3: Zero3CpuOffloadConfig
    bar: bool  # progress bar (a terminal) rather than plain lines
    stop_file: str | None = None  # the local launcher creates it to ask for a stop


@attrs.frozen
class RankResult:
    """What a rank reports back when it finished."""

    first_step: int  # the step training started from (0, or the checkpoint's)
    last_step: int  # the last step completed
    initial_eval: float | None
    final_eval: float | None
    interrupted: bool
    checkpoint: str | None  # the last checkpoint saved
    exported: str | None = None  # the --export directory, once written


def learning_rate(step: int, options: TrainOptions) -> float:
    """The learning rate of step ``step`` (0-based): linear warmup, cosine decay to lr/10."""
    if step < options.warmup_steps:
        return options.lr * (step + 1) / options.warmup_steps
    span = max(options.steps - options.warmup_steps, 1)
    cosine = 0.5 * (1 + math.cos(math.pi * min((step - options.warmup_steps) / span, 1.0)))
    return options.lr * (0.1 + 0.9 * cosine)


class _StopFlag:
    """Set by SIGINT/SIGTERM or by the launcher's stop file; read at step ends."""

    def __init__(self, stop_file: str | None, *, announce: bool) -> None:
        self.stop_file = Path(stop_file) if stop_file else None
        self.announce = announce  # say that the signal was heard (the launcher does otherwise)
        self._first: float | None = None

    def install(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            # Capability: loops off the main thread (or without Unix signals) refuse
            # handlers; Ctrl-C then arrives as KeyboardInterrupt, handled by the caller.
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, self._signalled)

    def uninstall(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            # The same capability as in install(): nothing was installed where it fails.
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.remove_signal_handler(sig)

    def _signalled(self) -> None:
        now = time.monotonic()
        # A launcher forwards the terminal's Ctrl-C a moment later (torchrun
        # does): only a second request a while after the first aborts.
        if self._first is not None and now - self._first > 1.0:
            raise KeyboardInterrupt
        if self._first is None and self.announce:
            print("stopping after the current step", file=sys.stderr, flush=True)
        self._first = self._first or now

    @property
    def requested(self) -> bool:
        return self._first is not None or bool(self.stop_file and self.stop_file.exists())


class _Trainer:
    def __init__(
        self,
        ctx: RankContext,
        run: RunSettings,
        manager: Zero3CpuOffloadManager,
        tokenizer: Any | None = None,
    ) -> None:
        self.ctx, self.run, self.opts, self.manager = ctx, run, run.train, manager
        self.tokenizer = tokenizer  # --model's tokenizer; None: bytes are the tokens
        self.hf = run.train.model is not None  # module mode: the model computes the loss
        self.names = list(manager.layer_names)
        self.comm = manager.engine.comm  # its heartbeat and divergence check cover the loss too
        # With sequence parallelism the S ranks of a group share each batch (the manager
        # cuts its sequences): batches are dealt to the groups, the data-parallel ranks.
        self.sequence = run.zero3.sequence_parallel_size
        self.data_rank = ctx.rank // self.sequence
        self.data_world = ctx.world_size // self.sequence
        opts = self.opts
        self.sft: SftSteps | None = None  # examples rather than a text stream
        self._corpus: ByteCorpus | None = None
        try:
            if opts.data and find_source(opts.data).structured:
                self.sft = self._sft_steps()
            else:
                corpus = ByteCorpus.load(
                    data=Path(opts.data) if opts.data else None,
                    max_bytes=int(opts.corpus_mb * 1e6),
                )
                if self.hf:
                    assert manager.model is not None  # module mode
                    corpus = hf.tokenize(corpus, tokenizer, hf.vocab_size(manager.model))
                self._corpus = corpus
        except (ConfigError, InputError) as exc:
            raise TrainError(str(exc)) from exc
        self.checkpoints = Path(opts.out) / "checkpoints" if opts.out else None
        accum = run.zero3.gradient_accumulation_steps
        self.reporter = Reporter(
            enabled=ctx.rank == 0,
            bar=run.bar,
            total=opts.steps,
            log_every=opts.log_every,
            tokens_per_step=accum * opts.batch_size * opts.seq_len * self.data_world,
        )

    @property
    def corpus(self) -> ByteCorpus:
        """The text stream (not with examples)."""
        assert self._corpus is not None, "a run on examples has no text stream"
        return self._corpus

    def _sft_steps(self) -> SftSteps:
        """The steps over ``--data``'s examples (the tokenizer renders them)."""
        opts, manager = self.opts, self.manager
        if not self.hf or manager.model is None:
            raise ConfigError(
                f"--data {opts.data}: examples (records or a dataset) need --model DIR, a "
                "transformers causal LM with its tokenizer; the built-in GPT trains on text"
            )
        data = SftData.load(
            opts.data,  # type: ignore[arg-type]  # checked by the caller
            tokenizer=self.tokenizer,
            vocab=hf.vocab_size(manager.model),
            max_len=opts.seq_len,
            seed=opts.seed,
            eval_data=opts.eval_data,
            data_format=opts.data_format,
            data_field=opts.data_field,
            loss_on=opts.loss_on,
            bad_records=opts.bad_records,
            pack=opts.pack,
        )
        return SftSteps(
            data,
            manager,
            rank=self.data_rank,
            world_size=self.data_world,
            batch_size=opts.batch_size,
            accumulation=self.run.zero3.gradient_accumulation_steps,
            eval_batches=opts.eval_batches,
        )

    def _batch(self, split: str, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        opts = self.opts
        # The step's global batch is laid out micro-step by micro-step, rank by rank: the
        # same sequences whatever the world size (see train.run_record).
        first = (micro * self.data_world + self.data_rank) * opts.batch_size
        return self.corpus.batch(
            split=split,
            seed=opts.seed,
            step=step,
            first=first,
            batch_size=opts.batch_size,
            seq_len=opts.seq_len,
        )

    def _loss(self, out: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = out.float().requires_grad_()  # the loss is computed outside the manager
        loss = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), y.to(out.device).reshape(-1))
        return loss, logits

    async def sums(self, *values: float) -> list[float]:
        """``values`` summed over the data-parallel ranks (a collective; the ranks of a
        sequence group report the same values)."""
        t = torch.tensor(values, dtype=torch.float64, device=self.comm.device)
        await self.comm.all_reduce_sum(t, what="the reported losses")
        return [v / self.sequence for v in t.tolist()]

    async def mean(self, *values: float) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.comm.device)
        await self.comm.all_reduce_sum(t, what="the reported losses")
        return [v / self.ctx.world_size for v in t.tolist()]

    async def _eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> float:
        with torch.no_grad():  # forward only: the manager keeps nothing for backward
            if self.hf:
                out = await self.manager.forward(input_ids=x, labels=x, use_cache=False)
                return float(out.loss.item())
            out = await self.manager.forward_pass(x, self.names)
        loss, _ = self._loss(out, y)
        return loss.item()

    async def evaluate(self) -> float:
        model = self.manager.model if self.hf else None
        if model is not None:
            model.eval()  # no dropout while evaluating
        if self.sft is not None:
            try:
                with torch.no_grad():
                    local = await self.sft.eval_sums()
            finally:
                if model is not None:
                    model.train()
            total, count = await self.sums(*local)  # the eval set's token mean
            return total / count if count else float("nan")
        try:
            total = 0.0
            for i in range(self.opts.eval_batches):
                total += await self._eval_loss(*self._batch("eval", i, 0))
        finally:
            if model is not None:
                model.train()
        (mean,) = await self.mean(total / self.opts.eval_batches)
        return mean

    async def _micro_step(self, x: torch.Tensor, y: torch.Tensor, lr: float) -> tuple[float, int]:
        """Forward and backward of one micro-batch; its loss and its valid tokens.

        The loss is the micro-batch's mean over its valid (not ignored, -100) label
        tokens, and the backward says how many there were (``tokens=``), so the update
        follows the global token mean of the step's batch over all ranks and micro-steps.
        """
        if self.hf:
            # transformers shifts the labels itself: seq_len - 1 predictions per sequence.
            out = await self.manager.forward(input_ids=x, labels=x, use_cache=False)
            tokens = int((x[:, 1:] != _IGNORED).sum())
            await self.manager.backward(out.loss, tokens=tokens)
            return float(out.loss.item()), tokens
        out = await self.manager.forward_pass(x, self.names)
        loss, logits = self._loss(out, y)
        loss.backward()
        tokens = int((y != _IGNORED).sum())
        await self.manager.backward_pass(logits.grad, self.names, learning_rate=lr, tokens=tokens)
        return loss.item(), tokens

    async def train_step(self, step: int, lr: float) -> StepCounts:
        """One step; this rank's sum of per-token losses, its tokens and examples.

        Raises:
            TrainError: ``max_consecutive_nonfinite`` steps in a row had an inf/nan
                gradient (skipped by ``skip_nonfinite_steps``, on by default here).
        """
        try:
            if self.sft is not None:
                return await self.sft.train_step(lr)
            return await self._text_step(step, lr)
        except NonFiniteError as exc:
            raise TrainError(f"step {step + 1}: {exc}") from exc

    async def _text_step(self, step: int, lr: float) -> StepCounts:
        total, count = 0.0, 0
        accum = self.run.zero3.gradient_accumulation_steps
        for micro in range(accum):
            loss, tokens = await self._micro_step(*self._batch("train", step, micro), lr)
            total, count = total + loss * tokens, count + tokens
            await self.manager.optimizer_step(lr)
        windows = accum * self.opts.batch_size
        return StepCounts(total, count, windows * self.opts.seq_len, 0, windows)

    async def export(self) -> str | None:
        """Write ``--export`` (a collective): the model or its adapters, and its tokenizer
        and generation config (``train.export``)."""
        target = self.opts.export
        if target is None:
            return None
        try:
            path, extras = await export_model(self.manager, self.opts, self.tokenizer)
        except (CheckpointError, OSError) as exc:
            raise TrainError(f"--export {target}: {exc}") from exc
        what = "model" if self.tokenizer is not None else "model (bytes as tokens)"
        if self.opts.lora is not None or self.opts.peft_config is not None:
            what = "merged model" if self.opts.export_merged else "adapter"
        parts = [what, *extras]
        listed = ", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else what
        self.reporter.line(f"exported the {listed} to {path}")
        return str(path)

    async def save(self) -> str | None:
        if self.checkpoints is None:
            return None
        state = self.sft.training_state() if self.sft is not None else {}
        state["adapters"] = adapter_options(self.opts)  # what --resume must be given again
        path = str(await self.manager.save_checkpoint(self.checkpoints, training_state=state))
        self.reporter.line(f"saved checkpoint {path}")
        return path

    async def resume(self) -> int:
        assert self.checkpoints is not None
        try:
            mismatch = adapter_mismatch(self.checkpoints, self.manager, self.opts)
            if mismatch is not None:
                raise TrainError(f"--resume: {mismatch}")
            path = await self.manager.load_checkpoint(self.checkpoints)
        except CheckpointError as exc:
            raise TrainError(f"--resume: {exc}") from exc
        step = self.manager.steps_completed  # skipped fp16 steps included
        if self.sft is not None:
            try:
                self.sft.restore(read_metadata(path).get("training_state"), str(path))
            except Zero3Error as exc:
                raise TrainError(f"--resume: {exc}") from exc
        self.reporter.line(f"resumed from {path} at step {step}")
        return step


def _peak_rss() -> int:
    """The kernel's high-water mark of this process's resident memory: ``VmHWM`` (Linux),
    else ``ru_maxrss``. Linux's ``ru_maxrss`` carries the parent's mark over ``exec``, so
    a rank started by a larger process would report that process's peak instead."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass  # not Linux: getrusage's figure below
    scale = 1 if sys.platform == "darwin" else 1024  # macOS reports bytes, Linux KiB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


async def _loop(trainer: _Trainer, stop: _StopFlag) -> RankResult:
    opts, rep, rank = trainer.opts, trainer.reporter, trainer.ctx.rank
    first = await trainer.resume() if opts.resume else 0
    if first >= opts.steps:
        rep.line(f"the checkpoint is at step {first} and --steps is {opts.steps}: nothing to do")
        return RankResult(first, first, None, None, False, None, await trainer.export())
    initial = await trainer.evaluate()
    rep.line(f"step {first}: eval loss {initial:.4f}")
    saved, done, interrupted, started = None, first, False, time.perf_counter()
    rep.start(first)
    try:
        for step in range(first, opts.steps):
            lr = learning_rate(step, opts)
            t0 = time.perf_counter()
            local = await trainer.train_step(step, lr)
            # The step's global token mean (what the update followed) and its counts.
            *summed, stops = await trainer.sums(*local.values(), float(stop.requested))
            counts = StepCounts(*summed)
            loss, seen = counts.loss, trainer.sft.position if trainer.sft else None
            done, seconds = step + 1, time.perf_counter() - t0
            log.info(
                "train_step",
                rank=rank,
                step=done,
                loss=loss,
                lr=lr,
                seconds=seconds,
                tokens_per_s=counts.real / seconds,
                valid_tokens=int(counts.valid),
                padding_fraction=counts.padding_fraction,
                examples_seen=seen,
            )
            rep.step(
                done,
                loss=loss,
                lr=lr,
                seconds=seconds,
                memory=trainer.manager.get_memory_stats(),
                counts=counts,
                examples_seen=seen,
            )
            if opts.eval_every and done % opts.eval_every == 0 and done < opts.steps:
                rep.line(f"step {done}: eval loss {await trainer.evaluate():.4f}")
            if done % _TRIM_EVERY == 0:
                trim_heap()
            if opts.save_every and done % opts.save_every == 0:
                saved = await trainer.save()
            interrupted = stops > 0
            if interrupted:
                break
        final = await trainer.evaluate()
        peak = _peak_rss()
        log.info(
            "train_done",
            rank=rank,
            step=done,
            eval_loss=final,
            initial_eval_loss=initial,
            peak_rss_bytes=peak,
        )
        if saved is None or not saved.endswith(f"{done:08d}"):
            saved = await trainer.save()
    finally:
        rep.close()
    elapsed = time.perf_counter() - started
    verb = "interrupted after" if interrupted else "finished"
    rep.line(
        f"{verb} step {done}/{opts.steps} in {elapsed:.1f} s: "
        f"eval loss {initial:.4f} -> {final:.4f} (initial -> final)"
    )
    if interrupted:
        rep.line(
            "run the same command again to resume"
            if saved
            else "nothing saved: give --out DIR to keep it"
        )
        if opts.export:
            rep.line(f"not exported to {opts.export}: the run did not reach --steps")
        exported = None
    else:
        exported = await trainer.export()
    return RankResult(first, done, initial, final, interrupted, saved, exported)


async def train_rank(ctx: RankContext, run: RunSettings) -> RankResult:
    """Train on this rank (every rank of the group calls it).

    Raises:
        TrainError: for a user's mistake (a budget too small for the model, a
            checkpoint of another model, CUDA asked for but absent; with
            ``--model``: weights that do not match config.json, a tokenizer that
            cannot be loaded or gives ids beyond the vocabulary, an ``--export``
            that cannot be written).
    """
    opts = run.train
    if opts.out:
        logs = Path(opts.out) / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        zlogging.configure(json_path=logs / f"rank{ctx.rank}.jsonl", level=opts.log_level)
    stop = _StopFlag(run.stop_file, announce=ctx.rank == 0 and run.stop_file is None)
    stop.install()
    try:
        if opts.model is not None:
            return await _train_hf(ctx, run, stop, opts.model)
        shape = GPTShape(
            seq_len=opts.seq_len, d_model=opts.d_model, layers=opts.layers, heads=opts.heads
        )
        with torch.device("meta"):
            model = GPT(shape)
        try:
            manager = Zero3CpuOffloadManager.from_meta(
                run.zero3,
                ctx.group,
                model,
                seed=opts.seed,
                # HF Trainer's default: no weight decay for biases and norm weights.
                param_groups=trainer_param_groups(model, run.zero3.optimizer),
            )
        except (ConfigError, MemoryBudgetError) as exc:
            raise TrainError(flagify(str(exc))) from exc
        async with manager:
            trainer = _Trainer(ctx, run, manager)
            _banner(trainer, shape)
            return await _loop(trainer, stop)
    finally:
        stop.uninstall()


async def _train_hf(ctx: RankContext, run: RunSettings, stop: _StopFlag, model: str) -> RankResult:
    """Fine-tune the transformers model of ``--model`` (see ``train.hf``)."""
    try:
        tokenizer = hf.load_tokenizer(model)
        manager = hf.build_manager(
            run.zero3,
            ctx.group,
            model,
            seed=run.train.seed,
            peft_config=peft_config_of(run.train),
            freeze=run.train.freeze,
        )
    except (ConfigError, CheckpointError, MemoryBudgetError) as exc:
        raise TrainError(flagify(str(exc))) from exc
    async with manager:
        trainer = _Trainer(ctx, run, manager, tokenizer)
        _hf_banner(trainer, model)
        return await _loop(trainer, stop)


def _hf_banner(trainer: _Trainer, directory: str) -> None:
    ctx, opts, rep = trainer.ctx, trainer.opts, trainer.reporter
    model = trainer.manager.model
    assert model is not None  # module mode
    backend = "nccl" if trainer.manager.device.type == "cuda" else "gloo"
    count = total_numel(trainer.manager.engine.layouts)
    trainable = total_numel(trainer.manager.engine.layouts, frozen=False)
    start = "pretrained weights" if hf.has_weights(directory) else f"random init (seed {opts.seed})"
    rep.line(
        f"{type(model).__name__} from {directory} with {count / 1e6:.2f}M parameters, starting "
        f"from {start}, on {ctx.world_size} rank(s) ({backend}, {trainer.manager.device}); each "
        f"rank holds 1/{ctx.world_size} of the parameters, gradients and optimizer state"
    )
    if trainer.sequence > 1:
        rep.line(
            f"sequence parallel: each sequence split over {trainer.sequence} ranks, "
            f"{trainer.data_world} data-parallel group(s) (batch sizes below are per group)"
        )
    if trainable < count:
        adapters = f"LoRA {opts.lora.describe()}; " if opts.lora is not None else ""
        rep.line(f"trainable: {trainable / 1e6:.4f}M parameters ({adapters}the rest frozen)")
    tokens = (
        f"{type(trainer.tokenizer).__name__} of {directory}"
        if trainer.tokenizer is not None
        else "bytes as tokens: no tokenizer in the model directory"
    )
    accumulation = " x accumulation" if trainer.run.zero3.gradient_accumulation_steps > 1 else ""
    if trainer.sft is not None:
        rep.line(
            f"data: {trainer.sft.data.describe()}; {trainer.sft.global_batch} examples per "
            f"step ({opts.batch_size} per rank{accumulation}), loss on {opts.loss_on} tokens "
            f"({tokens})"
        )
        return
    corpus = trainer.corpus
    rep.line(
        f"data: {corpus.source}: {corpus.train.numel() / 1e6:.3f}M train tokens, "
        f"{corpus.eval.numel() / 1e6:.3f}M eval tokens ({tokens}); {rep.tokens_per_step} tokens "
        f"per step ({opts.batch_size} x {opts.seq_len} tokens per rank{accumulation})"
    )


def _banner(trainer: _Trainer, shape: GPTShape) -> None:
    ctx, opts, corpus = trainer.ctx, trainer.opts, trainer.corpus
    backend = "nccl" if trainer.manager.device.type == "cuda" else "gloo"
    trainer.reporter.line(
        f"GPT with {shape.parameter_count() / 1e6:.2f}M parameters ({shape.layers} blocks, "
        f"d_model {shape.d_model}, {shape.heads} heads, context {shape.seq_len} bytes) on "
        f"{ctx.world_size} rank(s) ({backend}, {trainer.manager.device}); each rank holds "
        f"1/{ctx.world_size} of the parameters, gradients and optimizer state"
    )
    trainer.reporter.line(
        f"data: {corpus.source}: {corpus.train.numel() / 1e6:.2f} MB train, "
        f"{corpus.eval.numel() / 1e6:.2f} MB eval; {trainer.reporter.tokens_per_step} "
        f"tokens per step ({opts.batch_size} x {opts.seq_len} bytes per rank"
        f"{' x accumulation' if trainer.run.zero3.gradient_accumulation_steps > 1 else ''})"
    )
