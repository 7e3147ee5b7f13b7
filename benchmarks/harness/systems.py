"""The systems a training benchmark compares, behind one interface: ``SYSTEMS[kind](spec, rank)``
with ``start()`` (join the group), ``setup(model)``, ``step(x, y, clock)`` (phases ``forward``,
``loss``, ``backward``, ``optimizer``; an HF model's loss is its own, from ``labels``),
``model_state()`` (bytes counted from the tensors the system exposes), ``info()`` and ``close()``.
Each kind's ``options`` are described in docs/benchmarks.md (peers, hf-peers).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import attrs
import torch
import torch.distributed as dist

from harness.workload import lm_loss

BETAS, EPS = (0.9, 0.999), 1e-8


class System(NamedTuple):
    """A system as a suite's table names it: how to build it, on how many ranks."""

    label: str
    kind: str  # a key of SYSTEMS
    world: int
    options: dict[str, Any]


def storage_bytes(groups: dict[str, Iterable[Any]]) -> dict[str, int]:
    """Bytes per group of the distinct storages behind the tensors, each counted once (views of
    one flat buffer count at its size; a DTensor by its local shard)."""
    seen, out = set(), {}
    for name, tensors in groups.items():
        out[name] = 0
        for t in (t for t in tensors if isinstance(t, torch.Tensor)):
            s = (t.to_local() if hasattr(t, "to_local") else t).untyped_storage()
            if s.data_ptr() not in seen and s.nbytes():
                seen.add(s.data_ptr())
                out[name] += s.nbytes()
    return {**out, "total": sum(out.values())}


def _state(opt: Any) -> list[torch.Tensor]:
    return [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]


class Torch:
    """Plain torch (one process, the whole batch), and FSDP2 (``fsdp2``: ``fully_shard`` on every
    child and the root, or with ``wrap="decoder_layers"`` on each of an HF model's
    ``model.model.layers`` and the root, as torchtitan does; ``cpu_offload`` adds
    ``CPUOffloadPolicy``, pinned on CUDA); then torch's AdamW."""

    def __init__(self, spec: dict[str, Any], rank: Any) -> None:
        self.spec, self.rank, self.options = spec, rank, dict(spec["options"])
        self.device = torch.device(spec.get("device", "cpu"))

    async def start(self) -> None:
        if self.spec["kind"] == "fsdp2":
            dist.init_process_group(self.spec.get("backend", "gloo"))

    def adamw(self, params: Iterable[torch.Tensor]) -> torch.optim.AdamW:
        fused = {"fused": self.options["fused"]} if "fused" in self.options else {}
        hyper = {"lr": self.spec["lr"], "weight_decay": self.spec["weight_decay"], **fused}
        return torch.optim.AdamW(params, betas=BETAS, eps=EPS, **hyper)

    async def setup(self, model: torch.nn.Module) -> None:
        if self.spec["kind"] == "fsdp2":
            from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

            pin = self.device.type == "cuda"  # pinned host memory for the copies
            kw = {"offload_policy": CPUOffloadPolicy(pin_memory=pin)}
            by_layer = self.options.get("wrap") == "decoder_layers"
            for module in [*(model.model.layers if by_layer else model.children()), model]:
                fully_shard(module, **kw if self.options.get("cpu_offload") else {})
        self.model = model if self.spec["kind"] == "fsdp2" else model.to(self.device)
        self.opt = self.adamw(model.parameters())

    async def forward_loss(self, call: Callable, x: Any, y: Any, clock: Any) -> torch.Tensor:
        """``call``'s forward (awaited if async), then the loss: an HF model's own from ``labels``
        (the input ids: it shifts them), else :func:`lm_loss` of the logits and ``y``."""
        clock.phase("forward")
        hf = self.spec["dims"].get("model") == "llama"
        out = call(input_ids=x, labels=x) if hf else call(x)
        out = await out if inspect.isawaitable(out) else out
        clock.phase("loss")
        return out.loss if hf else lm_loss(out, y)

    async def step(self, x: torch.Tensor, y: torch.Tensor, clock: Any) -> torch.Tensor:
        clock.phase("forward")
        self.model.zero_grad(set_to_none=True)
        loss = await self.forward_loss(self.model, x, y, clock)
        clock.phase("backward")
        loss.backward()
        clock.phase("optimizer")
        self.update()
        return loss

    def update(self) -> None:
        self.opt.step()

    def model_state(self) -> dict[str, int]:
        params = list(self.model.parameters())
        grads, state = [p.grad for p in params], _state(self.opt)
        return storage_bytes({"params": params, "grads": grads, "optimizer_state": state})

    def info(self) -> dict[str, Any]:
        return {}

    async def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class DeepSpeed(Torch):
    async def start(self) -> None:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")

    async def setup(self, model: torch.nn.Module) -> None:
        import deepspeed

        batch, adamw = self.spec["dims"]["global_batch"], {"lr": self.spec["lr"], "eps": EPS}
        adamw.update(betas=list(BETAS), weight_decay=self.spec["weight_decay"])
        offload = {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
        config = {"train_batch_size": batch, "gradient_accumulation_steps": 1}
        config["train_micro_batch_size_per_gpu"] = batch // self.rank.world
        config["optimizer"] = {"type": "AdamW", "params": adamw}
        config["zero_optimization"] = {"stage": 3, **offload}
        config.update(gradient_clipping=0.0, steps_per_print=10**9)
        self.model, params = model, model.parameters()
        self.engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=params)

    async def step(self, x: torch.Tensor, y: torch.Tensor, clock: Any) -> torch.Tensor:
        loss = await self.forward_loss(self.engine, x, y, clock)
        clock.phase("backward")
        self.engine.backward(loss)
        clock.phase("optimizer")
        self.engine.step()
        return loss

    def model_state(self) -> dict[str, int]:
        z, params = self.engine.optimizer, list(self.model.parameters())
        flat32 = getattr(z, "fp32_partitioned_groups_flat", [])
        # this rank's compute partitions (views of one flat CPU buffer), and the parameters kept
        # gathered (below the persistence threshold)
        compute = [*getattr(z, "fp16_partitioned_groups_flat", [])]
        compute += [getattr(p, "ds_tensor", None) for p in params]
        compute += [p.data for p in getattr(z, "persistent_parameters", [])]
        grads = [getattr(z, "grad_partitions_flat_buffer", None), *(p.grad for p in params)]
        groups = {"params": compute, "master_params": flat32, "grads": grads}
        groups["grads"] += [g.grad for g in flat32]
        return storage_bytes({**groups, "optimizer_state": _state(z.optimizer)})


class Split(Torch):
    """A bound, not a trainer (``split``): ``world`` processes, each running plain torch's
    forward and backward on its share of the batch and torch's AdamW on its share of every
    parameter (ZeRO's split of the update: elements ``[rank * n / world, (rank + 1) * n /
    world)`` of each), with no communication at all, so the ranks' models drift apart after
    the first step. Its step is ZeRO's work on these cores without moving anything between
    ranks."""

    async def setup(self, model: torch.nn.Module) -> None:
        rank, world = self.rank.rank, self.rank.world
        self.model, self.shares = model, []
        for p in model.parameters():
            n = p.numel()
            lo, hi = min(rank * -(-n // world), n), min((rank + 1) * -(-n // world), n)
            if hi > lo:  # a view of the parameter's storage: the update writes the model
                self.shares.append((p, lo, hi, p.detach().view(-1)[lo:hi]))
        self.opt = self.adamw([v for *_, v in self.shares])

    def update(self) -> None:
        for p, lo, hi, share in self.shares:
            share.grad = p.grad.view(-1)[lo:hi]
        self.opt.step()


class Ours(Torch):
    async def start(self) -> None:
        from zero3_offload import init_process_group_from_env

        self.lr_in_backward = self.options.pop("lr_in_backward", False)
        self.group = await init_process_group_from_env(self.spec.get("backend", "gloo"))

    async def setup(self, model: torch.nn.Module) -> None:
        from zero3_offload import OptimizerConfig, Zero3CpuOffloadConfig, Zero3CpuOffloadManager

        wd = self.spec["weight_decay"]
        opt = OptimizerConfig(kind="adamw", betas=BETAS, eps=EPS, weight_decay=wd)
        config = Zero3CpuOffloadConfig(optimizer=opt, device=self.device.type, **self.options)
        self.manager = Zero3CpuOffloadManager(config, self.group, model, **self.units(model))
        self.names = getattr(model, "layer_names", None)

    def units(self, model: torch.nn.Module) -> dict[str, Any]:
        return {}  # chain mode: the model's children are the layers

    async def step(self, x: torch.Tensor, y: torch.Tensor, clock: Any) -> torch.Tensor:
        manager, lr = self.manager, self.spec["lr"]
        clock.phase("forward")
        out = await manager.forward_pass(x, self.names)
        clock.phase("loss")
        out.requires_grad_()  # the loss lives outside the manager
        loss = lm_loss(out, y)
        loss.backward()
        clock.phase("backward")
        in_backward = lr if self.lr_in_backward else None  # the update inside backward_pass
        await manager.backward_pass(out.grad, self.names, learning_rate=in_backward)
        clock.phase("optimizer")
        await manager.optimizer_step(lr)
        return loss

    def model_state(self) -> dict[str, int]:
        m = self.manager.get_memory_stats()
        params, total = m.master_param_bytes + m.compute_copy_bytes, m.model_state_bytes()
        state = {"grads": m.gradient_bytes, "optimizer_state": m.optimizer_state_bytes}
        return {"params": params, **state, "total": total}

    def info(self) -> dict[str, Any]:
        m = attrs.asdict(self.manager.get_memory_stats())
        return {"library_memory_stats": {k: v for k, v in m.items() if k.endswith("_bytes")}}

    async def close(self) -> None:
        from zero3_offload import destroy_process_group

        await self.manager.close()
        destroy_process_group()


class OursModule(Ours):
    """Module mode: the manager runs the model's own forward; its units are the GPT's blocks
    (the rest the root unit), or by default an HF model's ``_no_split_modules``."""

    def units(self, model: torch.nn.Module) -> dict[str, Any]:
        blocks = [n for n in getattr(model, "layer_names", []) if n.startswith("block")]
        return {"units": blocks} if blocks else {}

    async def step(self, x: torch.Tensor, y: torch.Tensor, clock: Any) -> torch.Tensor:
        ticker = asyncio.ensure_future(self.tick())  # the event loop's responsiveness
        loss = await self.forward_loss(self.manager.forward, x, y, clock)
        clock.phase("backward")
        await self.manager.backward(loss)
        clock.phase("optimizer")
        await self.manager.optimizer_step(self.spec["lr"])
        ticker.cancel()
        return loss

    async def tick(self, every: float = 0.01) -> None:
        """Wake every ``every`` s; the worst lateness of a wake-up, per step, goes to info()."""
        self.ticks = [*getattr(self, "ticks", []), 0.0]
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(every)
            self.ticks[-1] = max(self.ticks[-1], time.perf_counter() - t0 - every)

    def info(self) -> dict[str, Any]:
        worst = sorted(getattr(self, "ticks", [0.0])[1:] or [0.0])  # the first step warms up
        ms = {"median_step": worst[len(worst) // 2] * 1e3, "max": worst[-1] * 1e3}
        return {**super().info(), "loop_worst_tick_ms": ms}


SYSTEMS = {"torch": Torch, "fsdp2": Torch, "deepspeed": DeepSpeed, "zero3_offload": Ours}
SYSTEMS.update({"split": Split, "ours-module": OursModule})
