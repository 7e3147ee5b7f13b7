"""The systems a training benchmark compares, behind one interface: ``SYSTEMS[kind](spec, rank)``
with ``start``, ``build(spec)``, ``setup(model)``, ``step(x, y, clock)``, ``model_state`` (bytes
of the tensors it exposes), ``info`` and ``close``; docs/benchmarks.md (peers) has their options."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

import zero3_offload as z
from harness import workload

BETAS, EPS = (0.9, 0.999), 1e-8


class System(NamedTuple):
    """A system as a suite's table names it: how to build it, on how many ranks."""

    label: str
    kind: str  # a key of SYSTEMS
    world: int
    options: dict[str, Any]
    dims: dict[str, Any] = {}  # noqa: RUF012  # what differs from the size's (its global batch)


def storage_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the distinct storages behind the tensors (a DTensor's: its local shard's)."""
    storages = [(t.to_local() if hasattr(t, "to_local") else t).untyped_storage() for t in tensors]
    return sum({s.data_ptr(): s.nbytes() for s in storages}.values())


def _state(opt: Any) -> list[torch.Tensor]:
    return [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]


class Torch:
    """Plain torch, or FSDP2 (every child and the root, or HF decoder layers and the root;
    ``checkpoint``: each decoder layer recomputed in backward, as torchtitan's full AC)."""

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

    async def build(self, spec: dict[str, Any]) -> torch.nn.Module:
        """The model: built from the seed, or loaded in full from ``spec["pretrained"]``."""
        path, dims = spec.get("pretrained"), spec["dims"]
        return workload.load(dims, path, spec["seed"]) if path else workload.build(dims)

    async def setup(self, model: torch.nn.Module) -> None:
        if self.spec["kind"] == "fsdp2":
            from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

            policy = CPUOffloadPolicy(pin_memory=self.device.type == "cuda")  # pinned for CUDA
            kw = {"offload_policy": policy} if self.options.get("cpu_offload") else {}
            by_layer = self.options.get("wrap") == "decoder_layers"
            hf = getattr(model, "get_base_model", lambda: model)()  # inside a peft wrapper
            for module in [*(self.checkpointed(hf) if by_layer else model.children()), model]:
                fully_shard(module, **kw)
        elif self.options.get("checkpoint"):
            self.checkpointed(model)
        self.model = model if self.spec["kind"] == "fsdp2" else model.to(self.device)
        self.opt = self.adamw(p for p in model.parameters() if p.requires_grad)

    def checkpointed(self, hf: torch.nn.Module) -> Any:
        """The HF model's decoder layers, each recomputed in backward with the ``checkpoint``
        option (torchtitan's full AC)."""
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        layers = hf.model.layers
        for i, layer in enumerate(layers if self.options.get("checkpoint") else ()):
            layers[i] = checkpoint_wrapper(layer, preserve_rng_state=False)
        return layers

    async def forward_loss(self, call: Callable, x: Any, y: Any, clock: Any) -> torch.Tensor:
        """``call``'s forward (awaited if async), then the loss (an HF model's own, from labels)."""
        clock.phase("forward")
        hf = self.spec["dims"].get("model") == "llama"
        out = call(input_ids=x, labels=x) if hf else call(x)
        out = await out if inspect.isawaitable(out) else out
        clock.phase("loss")
        return out.loss if hf else workload.lm_loss(out, y)

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

    def model_state(self) -> int:
        params = list(self.model.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        return storage_bytes([*params, *grads, *_state(self.opt)])

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

        batch, cpu = self.spec["dims"]["global_batch"], {"device": "cpu"}
        sp, mpu = self.options.get("sequence_parallel_size", 1), getattr(self, "mpu", None)
        adamw = {"lr": self.spec["lr"], "eps": EPS, "betas": list(BETAS)}
        adamw["weight_decay"], micro = self.spec["weight_decay"], batch * sp // self.rank.world
        config = {"train_batch_size": batch, "train_micro_batch_size_per_gpu": micro}
        config["optimizer"] = {"type": "AdamW", "params": adamw}
        config["zero_optimization"] = {"stage": 3, "offload_optimizer": cpu, "offload_param": cpu}
        config.update(gradient_accumulation_steps=1, gradient_clipping=0.0, steps_per_print=10**9)
        config.update({"sequence_parallel_size": sp} if sp > 1 else {})
        if self.options.get("checkpoint"):  # transformers' own, as DeepSpeed's users enable it
            model.gradient_checkpointing_enable({"use_reentrant": False})
        self.model, params = model, [p for p in model.parameters() if p.requires_grad]
        self.engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=params,
                                               mpu=mpu)  # fmt: skip

    async def step(self, x: torch.Tensor, y: torch.Tensor, clock: Any) -> torch.Tensor:
        loss = await self.forward_loss(self.engine, x, y, clock)
        clock.phase("backward")
        self.engine.backward(loss)
        clock.phase("optimizer")
        self.engine.step()
        return loss

    def model_state(self) -> int:
        """Bytes of the partitions, kept parameters, masters, gradients, state."""
        opt, params = self.engine.optimizer, list(self.model.parameters())
        flat32 = getattr(opt, "fp32_partitioned_groups_flat", [])
        tensors = [*getattr(opt, "fp16_partitioned_groups_flat", []), *flat32]
        tensors += _state(opt.optimizer)
        tensors += [p.data for p in getattr(opt, "persistent_parameters", [])]
        tensors += [getattr(opt, "grad_partitions_flat_buffer", None), *(t.grad for t in flat32)]
        tensors += [t for p in params for t in (getattr(p, "ds_tensor", None), p.grad)]
        return storage_bytes(t for t in tensors if isinstance(t, torch.Tensor))


class Alst(DeepSpeed):
    """DeepSpeed ZeRO-3 offload with ALST's pieces from its installed version: ``TiledMLP``
    (every LlamaMLP over ``tile`` tokens at a time), ``TiledFusedLogitsLoss`` (``loss_tile``
    tokens at a time) and, with ``sequence_parallel_size``, Ulysses sequence parallelism
    (``UlyssesSPAttentionHF`` over sdpa: each rank of a group runs its slice of the group's
    sequence; the loss is the group's summed slices over the sequence's label count)."""

    async def setup(self, model: torch.nn.Module) -> None:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP, UlyssesSPAttentionHF

        tile, sp = self.options["tile"], self.options.get("sequence_parallel_size", 1)
        if sp > 1:
            self.mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sp, 1)

        def tiled(mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
            params = [mlp.down_proj.weight, mlp.gate_proj.weight, mlp.up_proj.weight]
            shards = -(-x.shape[-2] // tile)
            return TiledMLP.apply(type(mlp).plain, mlp, x, shards, params)

        for layer in model.model.layers:
            type(layer.mlp).plain = getattr(type(layer.mlp), "plain", type(layer.mlp).forward)
            type(layer.mlp).forward = tiled
        self.options.setdefault("checkpoint", True)
        await super().setup(model)

    async def forward_loss(self, call: Callable, x: Any, y: Any, clock: Any) -> torch.Tensor:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss
        from torch.distributed.nn.functional import all_gather

        clock.phase("forward")
        mpu, n = getattr(self, "mpu", None), x.shape[1]
        sp, rank = (mpu.get_sequence_parallel_world_size(), mpu.get_sequence_parallel_rank()
                    ) if mpu else (1, 0)  # fmt: skip
        mine = slice(rank * n // sp, (rank + 1) * n // sp)
        positions = torch.arange(n, device=x.device).unsqueeze(0)[:, mine]
        hidden = self.model.model(input_ids=x[:, mine], position_ids=positions).last_hidden_state
        clock.phase("loss")
        labels = torch.nn.functional.pad(x[:, 1:], (0, 1), value=-100)  # shifted before a cut

        def chunk(model: torch.nn.Module, h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            logits = model.lm_head(h).float()
            return torch.nn.functional.cross_entropy(logits, t.view(-1), reduction="sum")

        shards, head = -(-hidden.shape[1] // self.options["loss_tile"]), [self.model.lm_head.weight]
        loss = TiledFusedLogitsLoss.apply(chunk, self.model, hidden, labels[:, mine], None, shards,
                                          head, "sum")  # fmt: skip
        sums = all_gather(loss, mpu.get_sequence_parallel_group()) if mpu else [loss]
        return sum(sums) / (labels != -100).sum()


class Split(Torch):
    """A bound: each rank's forward, backward and 1/world of AdamW, no communication."""

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
        self.lr_in_backward = self.options.pop("lr_in_backward", False)
        self.budget = self.options.pop("memory_per_rank", None)  # the planner's choice
        self.group = await z.init_process_group_from_env(self.spec.get("backend", "gloo"))
        wd, device = self.spec["weight_decay"], self.device.type
        opt = z.OptimizerConfig(kind="adamw", betas=BETAS, eps=EPS, weight_decay=wd)
        self.config = z.Zero3CpuOffloadConfig(optimizer=opt, device=device, **self.options)

    async def build(self, spec: dict[str, Any]) -> torch.nn.Module:
        """Module mode from saved weights: ``from_pretrained`` (each rank reads its slices)."""
        if not (path := spec.get("pretrained")) or spec["kind"] != "ours-module":
            return await super().build(spec)
        lora = {"peft_config": workload.lora_config(r)} if (r := spec["dims"].get("lora")) else {}
        if self.budget:  # as a user would: the budget and the micro-batch, nothing else
            from zero3_offload.plan import MemoryBudget  # only here: its imports weigh

            shape = (spec["dims"]["global_batch"] // self.rank.world, spec["dims"]["seq"])
            lora["memory_per_rank"] = MemoryBudget(self.budget, batch_shape=shape)
        load = z.Zero3CpuOffloadManager.from_pretrained
        self.manager = load(self.config, self.group, path, **lora, seed=spec["seed"])
        return self.manager.model

    async def setup(self, model: torch.nn.Module) -> None:
        self.names = getattr(model, "layer_names", None)  # chain mode: the children are the layers
        if hasattr(self, "manager"):  # built from saved weights
            return
        blocks = [n for n in self.names or [] if n.startswith("block")]  # module mode: units
        units = {"units": blocks} if blocks and self.spec["kind"] == "ours-module" else {}
        self.manager = z.Zero3CpuOffloadManager(self.config, self.group, model, **units)

    async def step(self, x: torch.Tensor, y: torch.Tensor, clock: Any) -> torch.Tensor:
        manager, lr = self.manager, self.spec["lr"]
        clock.phase("forward")
        out = await manager.forward_pass(x, self.names)
        clock.phase("loss")
        out.requires_grad_()  # the loss lives outside the manager
        loss = workload.lm_loss(out, y)
        loss.backward()
        clock.phase("backward")
        in_backward = lr if self.lr_in_backward else None  # the update inside backward_pass
        await manager.backward_pass(out.grad, self.names, learning_rate=in_backward)
        clock.phase("optimizer")
        await manager.optimizer_step(lr)
        return loss

    def model_state(self) -> int:
        return self.manager.get_memory_stats().model_state_bytes()

    async def close(self) -> None:
        await self.manager.close()
        z.destroy_process_group()


class OursModule(Ours):
    """Module mode: the units are the GPT's blocks, or an HF model's ``_no_split_modules``."""

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
        worst = sorted(self.ticks[1:] or [0.0])  # the first step warms up
        ms = {"median_step": worst[len(worst) // 2] * 1e3, "max": worst[-1] * 1e3}
        given, ran = self.config.to_dict(), self.manager.config.to_dict()
        chosen = {k: v for k, v in ran.items() if given.get(k) != v}
        return {"loop_worst_tick_ms": ms, **({"chosen": chosen} if self.budget else {})}


SYSTEMS = {"torch": Torch, "fsdp2": Torch, "deepspeed": DeepSpeed, "zero3_offload": Ours}
SYSTEMS["deepspeed-alst"] = Alst
SYSTEMS.update({"split": Split, "ours-module": OursModule})
