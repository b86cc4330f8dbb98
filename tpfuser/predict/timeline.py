"""One rank's forward and backward as two lanes, compute and communication.

The model, in milliseconds per rank:

* The compute lane runs the pass's pieces (calibration.FORWARD_PIECES,
  BACKWARD_PIECES) one after another, in that order, each for its calibrated
  time; the communication lane runs the collectives over tp
  (collectives.forward_collectives, backward_collectives) one after another, each for
  its time from the interconnect's table (comm.py).
* A collective starts when the GEMM (chunk) that produces it has ended and
  the lane is free; a gather before a linear starts when the piece before the
  linear has ended. A compute piece waits for the collectives it reads.
* A linear whose collective the schedule chunks (parallel/collectives.py's
  records: algorithm, chunks) cuts that collective and the GEMMs beside it into N along the tokens, each
  chunk's GEMM time the calibrated N-chunk time over N: after a GEMM, chunk
  i's collective runs beside chunk i+1's GEMM and the piece after the linear
  waits for the last; before one, chunk i's GEMM waits for chunk i's gather
  only. Fill (the first gather) and drain (the last reduction) stay exposed.
  A GEMM with no chunked collective beside it runs whole.
* A collective that runs whole is in the pass's stream order (STREAM_ORDERED):
  the next compute piece waits for it, whether it reads it or not (nvFuser
  posts a fusion's communication between its kernels, on their stream). So
  unchunked, every collective is exposed.
* A ring (algorithm "ring", sequence parallelism: nvFuser's P2P
  decomposition, tp steps) cuts its GEMMs into tp chunks, each the
  calibrated tp-chunk time over tp (refused where the calibration did not
  time tp chunks). Each step that moves data is one P2P send of step_bytes
  (one rank's chunk) over one NVLink path, timed by the interconnect's
  figures for the ring's backend: NCCL send/recv, or the copy engine
  (comm.P2P_BY_BACKEND). All-gather + GEMM (before a column-parallel
  linear): step 0's GEMM runs on the rank's own chunk and waits for no
  transfer; transfer j (j = 1 .. tp-1) starts once the input is made and the
  one before it has ended, and GEMM chunk j waits for it. GEMM +
  reduce-scatter (after a row-parallel linear, after a column-parallel input
  gradient): GEMM chunk i makes the partial sum of rank (r+i) mod tp; chunk
  0's is the rank's own, chunk i's (i >= 1) is sent once made, beside the
  next chunk's GEMM, so the last send is exposed; then a local sum of the
  tp partials (a pointwise kernel reading tp x step_bytes and writing
  step_bytes) runs at the bytes per second of the calibration's forward
  GELU (pointwise_rate). Every rank runs the same steps: a rank's last
  partial arrives when its own last send ends.
* While both lanes are busy, the compute piece runs slower by its measured
  ratio beside a 32-CTA copy (calibration "beside_copy"), else by the mean
  measured ratio, else by SLOWDOWN_BESIDE_COMM; the collective by
  COMM_SLOWDOWN_BESIDE_COMPUTE. Beside a copy-engine transfer (sm_free) the
  compute piece runs at full speed: the copy engine takes no SMs (assumed:
  what the copy takes of the GPU's memory bandwidth slows no GEMM).

Exposed communication is the time the compute lane waits (on a collective).
"""

from __future__ import annotations

from dataclasses import dataclass

from tpfuser.parallel.collectives import backward_collectives, forward_collectives
from tpfuser.parallel.placements import LINEAR_STYLES
from tpfuser.predict.calibration import BACKWARD_PIECES, FORWARD_PIECES, is_gemm

COMPUTE, COMM = "compute", "comm"
# Assumed where the calibration has no measured ratio: NCCL's kernels hold 16-32
# of the H200's 132 SMs for a collective over NVLink (a CTA a channel) and the
# GEMM's tiles run on the rest, ~1.1x slower (tools/calibrate.py measures it
# beside a 32-CTA copy loop).
SLOWDOWN_BESIDE_COMM = 1.10
# Assumed: a collective is bound by NVLink, not by what the GEMM takes of HBM.
COMM_SLOWDOWN_BESIDE_COMPUTE = 1.0
STREAM_ORDERED = True   # documentation of the rule above; the model has no other
RING_BACKENDS = {"nccl": "NCCL", "cuda": "CE"}   # a ring's backend, in its rows' names (CE: the copy engine)
ROW = {name for name, style in LINEAR_STYLES.items() if style == "row"}
# The LayerNorm whose backward makes the gradients summed over the sequence shards of the region a
# row-parallel linear ends (collectives.sequence_summed_params): attention's is ln_1's, the MLP's ln_2's.
REGION_LAYERNORM = {"attn.c_proj": "ln_1", "mlp.c_proj": "ln_2"}


@dataclass(frozen=True)
class Op:
    name: str           # "mlp.c_fc [2/4]", "allreduce after attn.c_proj"
    lane: str           # COMPUTE or COMM
    ms: float           # alone
    piece: str          # the row it is summed into
    kind: str           # gemm, attention, pointwise, collective
    deps: tuple = ()    # indices of ops it waits for
    slowdown: float = 1.0
    whole_ms: float = 0.0   # a collective: its time alone unchunked (chunking it costs its chunks' ms over this)
    sm_free: bool = False   # a transfer that takes no SMs (the copy engine's): compute beside it runs at full speed


@dataclass(frozen=True)
class Span:
    op: Op
    start: float
    end: float


def simulate(ops: list[Op]) -> list[Span]:
    """Run both lanes in order, each op when its lane is free and its deps have ended."""
    queues = {lane: [i for i, op in enumerate(ops) if op.lane == lane] for lane in (COMPUTE, COMM)}
    heads, done, start, running, t = {COMPUTE: 0, COMM: 0}, {}, {}, {}, 0.0
    while True:
        for lane, queue in queues.items():
            if lane not in running and heads[lane] < len(queue):
                i = queue[heads[lane]]
                if all(d in done for d in ops[i].deps):
                    running[lane], start[i] = [i, ops[i].ms], t
                    heads[lane] += 1
        if not running:
            if all(heads[lane] == len(q) for lane, q in queues.items()):
                return [Span(op, start[i], done[i]) for i, op in enumerate(ops)]
            stuck = [ops[q[heads[lane]]].name for lane, q in queues.items() if heads[lane] < len(q)]
            raise ValueError(f"timeline: no op can start (waiting: {', '.join(stuck)}): a dependency on a later op")
        both = len(running) == 2
        quiet = both and ops[running[COMM][0]].sm_free
        rate = {lane: (1.0 / (ops[i].slowdown if lane == COMPUTE else COMM_SLOWDOWN_BESIDE_COMPUTE)
                       if both and not (quiet and lane == COMPUTE) else 1.0)
                for lane, (i, _) in running.items()}
        dt = min(left / rate[lane] for lane, (_, left) in running.items())
        t += dt
        for lane in list(running):
            running[lane][1] -= dt * rate[lane]
            if running[lane][1] <= 1e-12:
                done[running.pop(lane)[0]] = t


def attach(colls) -> dict:
    """(site, linear; or "param", its LayerNorm) -> the collectives posted there; teams of one (not posted) left out."""
    out = {}
    for c in colls:
        if c.team == 1:
            continue
        if c.axis != "tp":
            raise ValueError(f"--predict: a collective over {c.axis} ({c.where}) is not modelled: dp must be 1")
        key = ("param", REGION_LAYERNORM[c.linear]) if c.site == "param_grad" else (c.site, c.linear)
        out.setdefault(key, []).append(c)
    return out


class _Pass:
    """Ops of one pass, appended in lane order; `wait`: what the next compute op waits for."""

    def __init__(self, kind, pieces, interconnect, schedule, cfg=None, tp=1):
        self.kind, self.pieces, self.comm, self.schedule = kind, pieces, interconnect, schedule
        self.cfg, self.tp = cfg, tp
        self.ops, self.wait, self.last = [], [], None
        measured = pieces.mean_slowdown()
        self.fallback = measured if measured is not None else SLOWDOWN_BESIDE_COMM
        self.slowdown_source = ("measured beside a 32-CTA copy (calibration)" if measured is not None
                                else f"assumed: SLOWDOWN_BESIDE_COMM = {SLOWDOWN_BESIDE_COMM}")

    def compute(self, piece: str, chunks: int = 1, part: int = 1, deps=()) -> int:
        kind = "gemm" if is_gemm(piece) else "attention" if piece == "attention" else "pointwise"
        slow = self.pieces.slowdown(self.kind, piece, chunks) if kind == "gemm" else None
        name = piece if chunks == 1 else f"{piece} [{part}/{chunks}]"
        ms = self.pieces.ms(self.kind, piece, chunks) / chunks
        self.ops.append(Op(name, COMPUTE, ms, piece, kind, tuple(deps) + tuple(self.wait), slow or self.fallback))
        self.wait, self.last = [], len(self.ops) - 1
        return self.last

    def collective(self, c, chunks: int = 1, part: int = 1) -> int:
        piece = f"{c.kind} {c.where}"
        name = piece if chunks == 1 else f"{piece} [{part}/{chunks}]"
        ms = self.comm.time_ms(c.kind, c.tensor_bytes / chunks, c.team)
        self.ops.append(Op(name, COMM, ms, piece, "collective", () if self.last is None else (self.last,),
                           whole_ms=self.comm.time_ms(c.kind, c.tensor_bytes, c.team)))
        return len(self.ops) - 1

    def transfer(self, c, step: int, deps=()) -> int:
        """Step `step` of ring c: one P2P send of its step_bytes over c's backend."""
        piece = f"{c.kind} {c.where} (ring, {RING_BACKENDS.get(c.backend, c.backend)})"
        self.ops.append(Op(f"{piece} [{step}/{c.chunks - 1}]", COMM, self.comm.p2p_ms(c.backend, c.step_bytes), piece,
                           "collective", tuple(deps), whole_ms=self.comm.time_ms(c.kind, c.tensor_bytes, c.team),
                           sm_free=c.backend == "cuda"))
        return len(self.ops) - 1

    def ring_gather(self, gemms, c) -> None:
        """All-gather + GEMM: GEMM chunk 0 on the rank's own chunk, chunk j once transfer j has brought it."""
        made = () if self.last is None else (self.last,)
        arrived = [self.transfer(c, j, made) for j in range(1, c.chunks)]
        for i in range(c.chunks):
            for g in gemms:
                self.compute(g, c.chunks, i + 1, deps=arrived[i - 1:i] if i else ())

    def ring_scatter(self, gemms, c) -> None:
        """GEMM + reduce-scatter: chunk i's partial sent once made (chunk 0's is the rank's own), then the local sum."""
        sent = []
        for i in range(c.chunks):
            for g in gemms:
                self.compute(g, c.chunks, i + 1)
            if i:
                sent.append(self.transfer(c, i, (self.last,)))
        piece = f"sum of the ring's partials {c.where}"
        ms = (c.chunks + 1) * c.step_bytes / pointwise_rate(self.pieces, self.cfg, self.tp) * 1e3
        self.ops.append(Op(piece, COMPUTE, ms, piece, "pointwise", tuple(sent[-1:]) + tuple(self.wait), self.fallback))
        self.wait, self.last = [], len(self.ops) - 1

    def stage(self, gemms, linear: str, phase: str, before=(), after=()) -> None:
        """A linear's GEMMs (each chunk runs `gemms` in order) with the gather they read or the collective they feed."""
        colls = list(before) + list(after)
        rings = [c for c in colls if c.algorithm == "ring"]
        if rings:
            if len(colls) != 1:
                raise ValueError(f"--predict: {linear} {phase}: a ring beside another collective is not modelled "
                                 f"({', '.join(c.where for c in colls)})")
            return self.ring_gather(gemms, rings[0]) if before else self.ring_scatter(gemms, rings[0])
        n = max((c.chunks for c in colls), default=1)
        gathered = [[self.collective(c, n, i + 1) for c in before] for i in range(n)]
        for i in range(n):
            for g in gemms:
                self.compute(g, n, i + 1, deps=gathered[i])
            fed = [self.collective(c, n, i + 1) for c in after]
        if after:
            self.wait.extend(fed)   # the piece after the linear reads the last chunk (and, in lane order, all)


def pointwise_rate(pieces, cfg, tp: int) -> float:
    """Bytes a second of a memory-bound pointwise kernel on the calibration's GPU: the forward GELU's
    (tools/calibrate.py: tanh GELU of the rank's (b s, 4 h / tp) bf16 activation, read once, written once)."""
    nbytes = 2 * cfg.batch * cfg.seq * (4 * cfg.n_embd // tp) * 2
    return nbytes / (pieces.ms("forward", "gelu") * 1e-3)


def forward_ops(cfg, layout, schedule, pieces, interconnect) -> tuple[list[Op], str]:
    slots = attach(forward_collectives(cfg, layout, schedule))
    p = _Pass("forward", pieces, interconnect, schedule, cfg, layout.tp)
    for piece in FORWARD_PIECES:
        if is_gemm(piece):
            p.stage([piece], piece, "forward", slots.get(("input", piece), ()), slots.get(("output", piece), ()))
        else:
            p.compute(piece)
    return p.ops, p.slowdown_source


def backward_ops(cfg, layout, schedule, pieces, interconnect) -> tuple[list[Op], str]:
    slots = attach(backward_collectives(cfg, layout, schedule))
    p = _Pass("backward", pieces, interconnect, schedule, cfg, layout.tp)
    for piece in BACKWARD_PIECES:
        linear, _, grad = piece.rpartition(".")
        if linear in ROW:   # both GEMMs read the gathered upstream gradient (SP)
            if grad == "wgrad":
                p.stage([piece, f"{linear}.dgrad"], linear, "backward", before=slots.get(("grad_output", linear), ()))
        elif grad == "wgrad":   # reads the gathered LayerNorm output (SP)
            p.stage([piece], linear, "backward weight", before=slots.get(("weight_input", linear), ()))
        elif grad == "dgrad":   # partial sums over tp: all-reduced (TP) or reduce-scattered (SP)
            p.stage([piece], linear, "backward", after=slots.get(("grad_input", linear), ()))
        else:
            p.compute(piece)
            for c in slots.get(("param", piece), ()):   # SP: the LayerNorm's and the row bias's gradients
                p.wait.append(p.collective(c))
    return p.ops, p.slowdown_source


def summarize(spans: list[Span]) -> dict:
    """Per piece (in order) and in total: compute alone, its slowdown beside
    collectives, communication, exposed communication; the collectives' time
    alone unchunked (comm_whole_ms); and the pass's time."""
    wall = max((s.end for s in spans), default=0.0)
    compute = sorted((s for s in spans if s.op.lane == COMPUTE), key=lambda s: s.start)
    comms = [s for s in spans if s.op.lane == COMM]
    edges = [0.0] + [x for s in compute for x in (s.start, s.end)] + [wall]
    idle = [(a, b) for a, b in zip(edges[::2], edges[1::2]) if b > a + 1e-12]
    rows: dict[str, dict] = {}
    for s in spans:
        row = rows.setdefault(s.op.piece, {"piece": s.op.piece, "kind": s.op.kind, "compute_ms": 0.0,
                                            "slowdown_ms": 0.0, "comm_ms": 0.0, "exposed_ms": 0.0})
        if s.op.lane == COMPUTE:
            row["compute_ms"] += s.op.ms
            row["slowdown_ms"] += max(0.0, (s.end - s.start) - s.op.ms)
        else:
            row["comm_ms"] += s.end - s.start
            row["comm_whole_ms"] = s.op.whole_ms
            row["exposed_ms"] += sum(max(0.0, min(b, s.end) - max(a, s.start)) for a, b in idle)
    keys = ("compute_ms", "slowdown_ms", "comm_ms", "comm_whole_ms", "exposed_ms")
    totals = {k: sum(r.get(k, 0.0) for r in rows.values()) for k in keys}
    waited = sum(b - a for a, b in idle)
    return {"pieces": list(rows.values()), **totals, "exposed_ms": waited, "pass_ms": wall,
            "events": [{"lane": s.op.lane, "name": s.op.name, "piece": s.op.piece, "kind": s.op.kind,
                        "start_ms": s.start, "end_ms": s.end, "alone_ms": s.op.ms} for s in spans]}


def predict(cfg, layout, schedule, pieces_by_pass, interconnect) -> dict:
    """Both passes' timelines and summaries; pieces_by_pass: calibration.Pieces of this tp and parallelism."""
    out = {}
    for kind, build in (("forward", forward_ops), ("backward", backward_ops)):
        ops, source = build(cfg, layout, schedule, pieces_by_pass, interconnect)
        out[kind] = {**summarize(simulate(ops)), "slowdown_source": source}
    return out
