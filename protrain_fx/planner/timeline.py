"""The step-time model (paper Appendix A.1): a configuration's forward, backward and optimizer laid out on the
compute and the host link, chunk by chunk; methods of `CostModel` (planner/cost.py), which holds the fields they
read.

The paper's T_iter = T_fwd + max(T_bwd + T_gpu_optim, T_cpu_optim), refined for when the
host's AdamW can run: T_iter = T_fwd + T_bwd + T_gpu_optim + the next forward's wait for the host, where the host
steps each offloaded chunk once its gradient has been reduced and copied down (one at a time, the lowest landed
chunk first, as host_queue.py does) and the next forward waits where it would load a chunk the host has
not stepped yet. The host's AdamW is slower while copies run over the link (they share the host's memory
bandwidth): its rate at each moment is the one measured beside copies running the same ways (`HostRates`).
T_gpu_optim is what the persistent chunks' device AdamW adds: each runs once its gradient is reduced, beside the
rest of the backward, where it adds only the part of its time that the backward's kernels do not hide (the
hardware profile measures how much matmuls hide; memory-bound kernels hide none), and all of it after the
backward (`_gpu_optim_s`); with gradient clipping they wait for `AdamW.step()` and add all of it. Where every
update waits for `AdamW.step()` (an optimizer that skips steps with an inf or NaN gradient: float16's loss
scaling), every step is timed as a clipped one none of whose offloaded chunks update during the backward.
With gradient clipping each host update either waits for the end of the backward, or runs as usual while also
copying aside what it changes (to undo it if the clip applies): `phases(config, clipped=...)`. The paper sums the
forward and backward per chunk as max(compute, communication); the runtime's copies do not keep to chunk windows
(its graphs reach a chunk's gather ahead of the device, so an upload starts as soon as a buffer frees), so here
each is laid out chunk by chunk on three lanes, the compute and the link's two ways:
  forward: a non-persistent chunk's upload (shard up, then the all-gather) starts once the link to the device is
    free and a buffer is (the chunk loaded n_buffer before it has been computed), and once the host has stepped
    it; a chunk computes once it is loaded and the chunk before is done, and is done no sooner than the swap-out
    copies beside it (a swapped block's are spread over the swap_interval blocks after it, its settle point), nor
    than the uploads of the chunks gathered again beside it (`regathers`: a chunk the forward reads again after
    other chunks, a tied embedding by the head, is released between, passes/chunks.py);
  backward (last chunk first): the last n_buffer non-persistent chunks are still in their buffers; the others
    upload as in the forward; a chunk computes and recomputes its checkpointed blocks (the whole forward) and
    its selective blocks (their marked ops: planner/selective.py), and is done no sooner than
    the swap-in copies beside it (prefetched swap_interval blocks ahead, behind the uploads queued so far); then
    its gradient is reduced, and an offloaded chunk's shard copied to the host: these copies run one at a time
    on their own stream beside the compute, and the host's AdamW of a chunk starts when its copy ends; an
    offloaded chunk reduces in one of REDUCE_BUFFERS buffers (runtime/chunks/reduce.py), so its reduce waits for the
    copy of the chunk that used that buffer before;
  a chunk gathered again at the forward's end is in fact one of the backward's buffered ones, and the one it
    displaced is uploaded: as many uploads;
  with one buffer a chunk's load cannot overlap the compute of the chunk before it (one buffer, in use);
  a chunk sharded on the device (`n_device_shard`, after the persistent ones) loads with its all-gather alone (no
    upload), reduce-scatters its gradient and copies nothing to the host: its update runs on the device, as a
    persistent chunk's does, over its shard's parameters.
Each copy runs at each moment at the rate measured beside what runs then: copies the other way, the host's AdamW
(which slows copies to the device), both or neither (`Link`, from an earlier pass of the
timelines). On the CPU (no overlap) everything runs in line.
A node's compute belongs to the chunk of its block (pre-block nodes, and those between two block lists, to the
first chunk; post-block ones to the last). Without a chunk layout the step is the profiled compute plus recompute.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, TypedDict

from protrain_fx.planner.link import HostRates, Link, step_clock
from protrain_fx.planner.plan import REDUCE_BUFFERS

if TYPE_CHECKING:
    from protrain_fx.planner.cost import Candidate
    from protrain_fx.planner.cost_fields import CostFields
else:
    CostFields = object  # (planner/cost_fields.py: the type checker's view of CostModel)


class ModeWork(TypedDict):
    """Each chunk's share of the work that the block modes alone set (`Timeline._per_chunk_of_modes`): seconds of
    forward and backward compute and of recompute, bytes of the swap-out and swap-in copies beside it."""

    forward: list[float]
    backward: list[float]
    recompute: list[float]
    swap_out: list[float]
    swap_in: list[float]


class ChunkWork(ModeWork):
    """Each chunk's share of the work (`Timeline._per_chunk`): its block modes' and the offloaded chunks the forward
    gathers again beside it."""

    regather: list[int]


class Timeline(CostFields):
    """Step time of a configuration: a base of `CostModel`, whose fields these read."""

    def _collective_s(self, op: str) -> float:
        """Seconds of one collective `op` of a chunk across ranks, alone (0 with one rank): the all-gather of its
        parameters, the all-reduce of a persistent chunk's gradient (every rank keeps all of it), the
        reduce-scatter of an offloaded one's to the shards."""
        if self.world_size == 1:
            return 0.0
        size = self.element_size if op == "all_gather" else self.master_bytes
        return self.hardware.collective_s(op, self.chunk_elems * size)

    def _gather_s(self) -> tuple[float, float]:
        """The all-gather of one non-persistent chunk's parameters (after its shard's upload, on the same stream),
        beside the compute: its seconds there, and the seconds it adds to the compute (`_beside_compute`)."""
        return self._beside_compute(self._collective_s("all_gather"))

    def _all_reduce_s(self) -> tuple[float, float]:
        """A persistent chunk's gradient all-reduce across ranks, on its own stream beside the next chunk's
        backward: its seconds there, and the seconds it adds to the compute, with the two passes over the reduce
        buffer the runtime makes on the compute stream once it has landed (the division by the world size in
        place, the copy into the chunk's gradient: each reads and writes the chunk; with one rank the gradient is
        written in place)."""
        if self.world_size == 1:
            return 0.0, 0.0
        lane, slower = self._beside_compute(self._collective_s("all_reduce"))
        nbytes = self.chunk_elems * self.master_bytes
        return lane, slower + 2 * 2 * nbytes / self.hardware.device_bytes_per_s  # (the rate counts reads and writes)

    def _beside_compute(self, seconds: float) -> tuple[float, float]:
        """A collective that takes `seconds` alone, run beside the compute: its time there, and how much later the
        compute ends for it (both share the device's cores and memory bandwidth: the hardware profile's
        `collective_stretch_beside_matmul` and `matmul_delay_beside_collective`)."""
        hw = self.hardware
        beside = seconds * hw.collective_stretch_beside_matmul
        return beside, beside * hw.matmul_delay_beside_collective

    def step_s(self, config: Candidate, clipped: int | None = None) -> float:
        """Predicted seconds per training step (forward, backward and optimizer) of `config`; `clipped`: a step
        with gradient clipping (`phases`)."""
        t = self.phases(config, clipped)
        if not self.overlap:
            return t["forward_s"] + t["backward_s"] + t["gpu_optim_s"] + t["cpu_optim_s"] + self.step_offset_s
        return t["forward_s"] + t["backward_s"] + t["gpu_optim_s"] + t["cpu_optim_wait_s"] + self.step_offset_s

    def host_adam_mean_s(self, config: Candidate) -> float | None:
        """The host AdamW's mean seconds per parameter over the offloaded chunks' updates of a step of `config`,
        at the rates beside the copies the timelines put there: what the step monitor measures in training. None
        where nothing is offloaded."""
        params = sum(self.chunk_params[config.n_persist + config.n_device_shard :]) / self.world_size
        return self.phases(config)["cpu_optim_s"] / params if params else None

    def _on_device(self, config: Candidate) -> list[int]:
        """Per chunk updated on the device (the persistent ones, then those sharded there), the parameter elements
        a rank updates."""
        sharded = range(config.n_persist, config.n_persist + config.n_device_shard)
        return [*self.chunk_params[: config.n_persist], *(self.shard_params[c] for c in sharded)]

    def _gpu_optim_s(
        self, config: Candidate, reduced: Sequence[float] | None = None, end: float = 0.0, *, early: bool = True
    ) -> float:
        """What the persistent chunks' AdamW on the device adds to the step. Each starts on the optimizer stream
        once its chunk's gradient is reduced (`reduced`, per chunk: `_backward_timeline`'s copy_end), the last
        chunk first, one at a time (runtime/chunks/ `_step_on_device_early`). Until the backward's compute ends
        (`end`) it runs beside it, `stretch` times as long as alone, and lengthens the backward by its time alone
        times 1 - hidden × matmul share: `hidden`, the share of it that matmuls hide (hardware profile), and the
        matmul share, the backward's time in kernels bound by arithmetic (`is_matmul`; the rest, bound by memory
        as the AdamW is, hides none of it). What is left of it after the backward (all of chunk 0's, reduced as
        the backward ends) adds all its time. `reduced` None: as if each but chunk 0's ran beside the backward (at
        most that is hidden: a lower bound, `step_bound_s`). `early` False (gradient clipping: updates wait for
        `AdamW.step()`) or no overlap (the CPU): every update adds all its time."""
        rate = self.hardware.device_adam_s(self.master_bytes)
        alone = [params * rate for params in self._on_device(config)]
        if not early or not self.overlap:
            return sum(alone)
        hw = self.hardware
        exposed = 1 - hw.device_adam_hidden_beside_matmul * self.backward_matmul_share
        added, lane = 0.0, 0.0
        for c in reversed(range(len(alone))):
            if reduced is None:
                beside = alone[c] if c else 0.0  # (of its time alone, what runs beside the backward)
            else:
                start = max(reduced[c], lane)
                beside = min(alone[c], max(0.0, end - start) / hw.device_adam_stretch_beside_matmul)
                lane = start + beside * hw.device_adam_stretch_beside_matmul + alone[c] - beside
            added += beside * exposed + alone[c] - beside
        return added

    def _block_extras(self, config: Candidate) -> tuple[list[float], list[int]]:
        """Per block, the seconds of its recompute (checkpointed, selective) and the bytes it swaps (swapped)."""
        modes = self.modes(config)
        recompute = [self.recompute_s(b, m) for b, m in enumerate(modes)]
        swapped = [self.saving(b, m) if m == "swap" else 0 for b, m in enumerate(modes)]
        return recompute, swapped

    def _per_chunk(self, config: Candidate, of_modes: ModeWork | None = None) -> ChunkWork:
        """Each chunk's share of the work (`_per_chunk_of_modes`, unless given as `of_modes`: the block layout's)
        and the offloaded chunks the forward gathers again beside it (`_regathered`)."""
        of_modes = self._per_chunk_of_modes(config) if of_modes is None else of_modes
        return ChunkWork(**of_modes, regather=self._regathered(config))

    def _per_chunk_of_modes(self, config: Candidate) -> ModeWork:
        """What of each chunk's share of the work the block modes alone set: seconds of forward and backward compute
        and of recompute, bytes of the swap-out copies (forward) and swap-in copies (backward) that run beside it."""
        n = self.n_chunk
        recompute, swapped = self._block_extras(config)
        fwd_c, bwd_c, rec_c, out_c, in_c = ([0.0] * n for _ in range(5))
        fwd_c[0] += self.other_fwd_s[0]
        fwd_c[n - 1] += self.other_fwd_s[1]
        bwd_c[0] += self.other_bwd_s[0]
        bwd_c[n - 1] += self.other_bwd_s[1]
        last, k = self.n_block - 1, self.swap_interval
        for b, c in enumerate(self.block_chunk):
            fwd_c[c] += self.block_fwd_s[b]
            bwd_c[c] += self.block_bwd_s[b]
            rec_c[c] += recompute[b]
            # a swapped block's copies run beside the next swap_interval blocks: out after it in the forward (its
            # settle point is k blocks on), in before it in the backward (prefetched k blocks ahead)
            for j in range(1, k + 1):
                out_c[self.block_chunk[min(b + j, last)]] += swapped[b] / k
                in_c[self.block_chunk[min(b + j, last)]] += swapped[b] / k
        return ModeWork(forward=fwd_c, backward=bwd_c, recompute=rec_c, swap_out=out_c, swap_in=in_c)

    def _regathered(self, config: Candidate) -> list[int]:
        """Per chunk, the offloaded chunks the forward gathers again beside it (`regathers`): with `n_persist`, not
        the block modes alone."""
        return [
            sum(1 for chunk, at in self.regathers if at == c and chunk >= config.n_persist) for c in range(self.n_chunk)
        ]

    def _forward_timeline(
        self, config: Candidate, per: ChunkWork, link: Link, ready: Sequence[float] | None = None
    ) -> dict:
        """The forward, chunk by chunk, on three lanes: the compute, the copies to the device and those to the
        host. A non-persistent chunk's upload (its shard up, then the all-gather, on one stream) starts once the
        link is free, a buffer is (the chunk loaded n_buffer before it has been computed: the graph reaches its
        gather ahead of the device, so runtime/chunks/gather.py loads as soon as a buffer frees) and, given `ready`
        (per chunk, seconds from the forward's start), once the host has stepped it. A chunk computes once it is
        loaded and the chunk before it is done, and is done no sooner than the swap-out copies beside it (their
        settle waits for them), nor than the chunks gathered again beside it (`regathers`: uploaded as it
        starts, once the link is free; their buffer is not waited for). On the CPU everything runs in line.
        `per`: `_per_chunk(config)`. Returns the end and the copies' (start, end) each way."""
        n, persist, (gather, slower) = self.n_chunk, config.n_persist, self._gather_s()
        host = persist + config.n_device_shard  # (the first chunk offloaded)
        shard = self.shard_elems * self.master_bytes  # an offloaded shard's master going up, its gradient down
        t, up, down = 0.0, 0.0, 0.0
        h2d: list[tuple[float, float]] = []
        d2h: list[tuple[float, float]] = []
        if not self.overlap:
            for c in range(n):
                load = (
                    (link.seconds("h2d", shard, t, forward=True) if c >= host else 0.0) + gather
                    if c >= persist
                    else 0.0
                )
                load += per["regather"][c] * (link.seconds("h2d", shard, t, forward=True) + gather)
                t += load + per["forward"][c] + link.seconds("d2h", per["swap_out"][c], t, forward=True)
            return {"end": t, "h2d": h2d, "d2h": d2h}
        buffers, end, loaded, following = max(1, config.n_buffer), [0.0] * n, {}, persist
        for c in range(n):
            gathers = 0  # all-gathers started beside this chunk's compute
            while following < n and following - buffers < max(c, persist):  # a buffer is free for it
                freed = end[following - buffers] if following - buffers >= persist else 0.0
                start = max(up, freed, ready[following] if ready is not None else 0.0)
                landed = link.copy("h2d", shard, start, h2d, forward=True) if following >= host else start
                up = loaded[following] = landed + gather
                following, gathers = following + 1, gathers + 1
            start = max(t, loaded.get(c, 0.0))
            again = 0.0
            for _ in range(per["regather"][c]):  # a chunk read again (a tied embedding by the head), loaded beside
                again = up = link.copy("h2d", shard, max(up, start), h2d, forward=True) + gather
                gathers += 1
            t = max(start + per["forward"][c] + gathers * slower, again)
            if per["swap_out"][c]:
                down = link.copy("d2h", per["swap_out"][c], max(down, start), d2h, forward=True)
                t = max(t, down)
            end[c] = t
        return {"end": t, "h2d": h2d, "d2h": d2h}

    def _backward_timeline(self, config: Candidate, per: ChunkWork, link: Link, host_ends: list | None = None) -> dict:
        """The backward, chunk by chunk (last to first), on the same three lanes. The last n_buffer non-persistent
        chunks are still in their buffers from the forward; each one before them is uploaded once the link is
        free and a buffer is (the chunk n_buffer before it in this order has been computed). A chunk computes
        (and recomputes its checkpointed blocks) once it is there and the chunk after it is done, and is done no
        sooner than the swap-in copies beside it, which queue behind the uploads (runtime/swap.py). When a
        chunk is done its gradients are reduced; the copies of offloaded shards to the host then run one at a
        time on their own stream, beside the compute (on the CPU, in line); an offloaded chunk's reduce first
        waits for the copy out of the buffer it reuses. Where the offloaded chunks share fewer host gradient
        shards than there are of them (`grad_slots`), the i-th to arrive waits, and the backward with it, until
        i - slots + 1 host updates have ended (`host_ends`, from the host timeline; None: not known yet). Returns
        the end of each chunk's reduce and copy, the backward's compute end, and the copies' (start, end) each
        way."""
        n, persist, (gather, slower) = self.n_chunk, config.n_persist, self._gather_s()
        host = persist + config.n_device_shard  # (the first chunk offloaded)
        all_reduce, all_reduce_slower = self._all_reduce_s()
        reduce_scatter, all_reduce_alone = self._collective_s("reduce_scatter"), self._collective_s("all_reduce")
        shard = self.shard_elems * self.master_bytes  # an offloaded shard's master going up, its gradient down
        order = list(reversed(range(persist, n)))  # the non-persistent chunks, in the order the backward needs them
        buffers = max(1, config.n_buffer)
        uploaded = set(order[buffers:])  # (the others are still in their buffers from the forward)
        t, up, copy_end, link_free, end, loaded, following = 0.0, 0.0, [0.0] * n, 0.0, [0.0] * n, {}, buffers
        reduced: list[int] = []  # offloaded chunks in the order they took a reduce buffer
        h2d: list[tuple[float, float]] = []
        d2h: list[tuple[float, float]] = []
        slots = self.grad_slots(config) if host_ends is not None else n - host  # (the bound's first pass: none)
        shared = slots < n - host
        # when each shard is given back (`shared`: only with `host_ends`)
        freed = sorted(e for e in host_ends if e is not None) if shared and host_ends is not None else []
        beside = 0.0  # what the collectives running beside the next chunk's compute add to it
        for c in reversed(range(n)):
            done = n - 1 - c  # chunks the backward has done so far (the first len(order) are `order`)
            if self.overlap:
                while following < len(order) and following - buffers < done:  # a buffer is free for it
                    start = max(up, end[order[following - buffers]])
                    landed = link.copy("h2d", shard, start, h2d) if order[following] >= host else start
                    up = loaded[order[following]] = landed + gather
                    following, beside = following + 1, beside + slower
                start = max(t, loaded.get(c, 0.0))
                t, beside = start + per["backward"][c] + per["recompute"][c] + beside, 0.0
                if per["swap_in"][c]:
                    up = link.copy("h2d", per["swap_in"][c], max(up, start), h2d)
                    t = max(t, up)
            else:
                load = (link.seconds("h2d", shard, t) if c >= host else 0.0) + gather if c in uploaded else 0.0
                t += load + per["backward"][c] + per["recompute"][c] + link.seconds("h2d", per["swap_in"][c], t)
            end[c] = t
            if c >= host:
                if len(reduced) >= REDUCE_BUFFERS:  # its buffer's last copy must have ended
                    t = max(t, copy_end[reduced[-REDUCE_BUFFERS]])
                if shared and len(reduced) >= slots:  # a gradient shard on the host must have been given back
                    t = max(t, freed[len(reduced) - slots])
                reduced.append(c)
            if persist <= c < host:  # a reduce-scatter into its shard on the device, then its update may start
                t += reduce_scatter
                copy_end[c] = t
                continue
            if c >= persist:  # a reduce-scatter: the compute stream waits for it (runtime/chunks/reduce.py)
                t += reduce_scatter
                begin = max(t, link_free) if self.overlap else t
            elif self.overlap:  # an all-reduce beside the next chunk's backward
                begin, beside = max(t, link_free) + all_reduce, beside + all_reduce_slower
            else:
                begin = t + all_reduce_alone  # (nothing runs beside it)
            copy = link.seconds("d2h", shard, begin) if c >= host else 0.0
            copy_end[c] = begin + copy
            if self.overlap:
                link_free = copy_end[c]
            else:
                t = copy_end[c]
            d2h.append((begin, copy_end[c]))
        return {"copy_end": copy_end, "end": t, "h2d": h2d, "d2h": d2h}

    def _host_timeline(
        self, config: Candidate, forward: dict, backward: dict, next_forward: float, clipped: int | None
    ) -> dict:
        """The host steps offloaded chunks one at a time, each once its gradient is there, the lowest landed one
        first (host_queue.py: the next forward needs it first), beside the backward's copies and the next
        forward's (which starts at `next_forward`); its AdamW's rate at each moment is the one measured beside
        the copies then (`HostRates`). With `clipped` only the last `clipped` chunks' updates start as their
        gradient lands, each also copying aside what it changes; the others' wait for the end of the backward
        and the device's updates. Returns when each chunk is stepped (None: not offloaded), the host's busy
        (start, end) spans and their total. Times from the backward's start."""
        hw, n = self.hardware, self.n_chunk
        arrival, work = list(backward["copy_end"]), [1.0] * n  # host work per parameter, in units of its AdamW
        if clipped is not None:
            adam = hw.host_adam_s(False, False, self.master_bytes)
            undo = hw.host_undo_s(self.master_bytes) / adam if adam > 0 else 0.0
            for c in range(config.n_persist + config.n_device_shard, n):
                if c < n - clipped:
                    arrival[c] = max(arrival[c], next_forward)
                else:
                    work[c] += undo
        pending, clock = set(range(config.n_persist + config.n_device_shard, n)), 0.0
        ends: list[float | None] = [None] * n
        spans: list[tuple[float, float]] = []
        if pending:  # (built only where the host has work: the search visits many configurations)
            rates = HostRates(hw, **step_clock(forward, backward, next_forward), master_bytes=self.master_bytes)
        while pending:
            landed = [c for c in pending if arrival[c] <= clock]
            if not landed:
                clock = min(arrival[c] for c in pending)
                continue
            chunk = min(landed)
            pending.remove(chunk)
            start, clock = clock, rates.end(clock, work[chunk] * self.chunk_params[chunk] / self.world_size)
            ends[chunk] = clock
            spans.append((start, clock))
        return {"ends": ends, "spans": spans, "busy": sum(b - a for a, b in spans)}

    def phases(self, config: Candidate, clipped: int | None = None) -> dict[str, float]:
        """The terms of `step_s`: forward and backward seconds (copies they do not hide included), the optimizer's
        on the device and on the host, and how long the next forward waits for the host's (no optimizer without
        chunks: it is the user's then). The offloaded chunks' host updates start as their gradient lands; with
        `clipped` (a step with gradient clipping, whose last clip did not apply), only the last `clipped` chunks'
        do, each also copying aside what it changes (to undo it if the clip applies: runtime/chunks/updates.py), and the
        others' wait for the end of the backward.

        The timelines are laid out twice: first with every copy at the link's idle rate, then with each at the
        rates beside what the first found running during it (copies the other way, the host's AdamW). The
        next forward is laid out once more with each chunk's upload waiting for its host update: the time that
        adds is the wait. Where every update waits for `AdamW.step()` (`updates_wait`), `clipped` is 0 whatever
        is asked."""
        hw = self.hardware
        if self.updates_wait:
            clipped = 0
        if self.n_chunk == 0:
            recompute, swapped = self._block_extras(config)
            hidden = (sum(self.block_fwd_s), sum(self.block_bwd_s)) if self.overlap else (0.0, 0.0)
            return {
                "forward_s": sum(self.other_fwd_s)
                + sum(self.block_fwd_s)
                + max(0.0, sum(swapped) / hw.d2h_bytes_per_s - hidden[0]),
                "backward_s": sum(self.other_bwd_s)
                + sum(self.block_bwd_s)
                + sum(recompute)
                + max(0.0, sum(swapped) / hw.h2d_bytes_per_s - hidden[1]),
                "gpu_optim_s": 0.0,
                "cpu_optim_s": 0.0,
                "cpu_optim_wait_s": 0.0,
            }
        per = self._per_chunk(config)
        link, host = Link(hw), None
        for _ in range(2):  # (the first pass at the idle rates, then at those beside what it laid out)
            forward = self._forward_timeline(config, per, link)
            # (in a clipped step no update gives its gradient shard back during the backward: the runtime takes
            # host memory for the step where the shared ones are held, runtime/chunks/storage.py)
            given_back = host["ends"] if host and clipped is None else None
            backward = self._backward_timeline(config, per, link, given_back)
            gpu_optim = self._gpu_optim_s(config, backward["copy_end"], backward["end"], early=clipped is None)
            next_forward = backward["end"] + gpu_optim
            host = self._host_timeline(config, forward, backward, next_forward, clipped)
            link = Link(hw, forward, backward, host["spans"], next_forward)
        assert host is not None
        ready = [0.0 if end is None else end - next_forward for end in host["ends"]]
        waited = self._forward_timeline(config, per, link, ready)
        return {
            "forward_s": forward["end"],
            "backward_s": backward["end"],
            "gpu_optim_s": gpu_optim,
            "cpu_optim_s": host["busy"],
            "cpu_optim_wait_s": max(0.0, waited["end"] - forward["end"]),
        }
