"""Every ``RONDE_*`` knob, declared once: variable, parser, accepted range, default, unit,
flag, meaning.

:mod:`ronde._config` reads the environment through :data:`KNOBS` (and Horovod's names
as fallbacks); ``docs/configuration.md``'s tables of variables and of ``ronderun``
flags are generated from it (``python -m ronde._knob_docs --write docs/configuration.md``)
and a test checks they are current, that every :class:`~ronde._config.Config` field has
exactly one knob whose shown default is the field's default, and that every flag exists.
Every numeric knob has a :class:`~ronde._values.Range` (generous, but finite): a value
outside it is refused where it is read (:meth:`Knob.read`), naming the variable actually
set and the range, by ``load()`` in every worker and by ``ronderun`` for its flags.
:data:`LAUNCHER_VARIABLES` are the ``RONDE_*`` variables a launcher sets for its
workers; any other ``RONDE_*`` variable is a typo, and ``load()`` warns about it.
"""

from __future__ import annotations

from ._values import (Knob, Range, parse_auto_bytes, parse_bind_addr, parse_bool,
                      parse_bytes, parse_hierarchical, parse_timeline_path)

_GIB = 1 << 30
_YEAR_S = 365 * 24 * 3600
_SECONDS = Range(0, _YEAR_S, above=True)  # timeouts and periods
_SECONDS_OR_0 = Range(0, _YEAR_S)         # ... where 0 means never or off
_BYTES = Range(0, 64 * _GIB, size=True)
_RANKS = Range(0, 1 << 20)


KNOBS: tuple[Knob, ...] = (
    Knob("fusion_threshold_bytes", "RONDE_FUSION_THRESHOLD", parse_bytes,
         accepted=_BYTES,
         default='`64MiB` (67108864)', unit='bytes ([size syntax](#sizes))',
         horovod=('HOROVOD_FUSION_THRESHOLD',), flag='--fusion-threshold-mb MB',
         flag_note='converted to bytes, `MB x 1048576`; must be >= 0',
         doc='Largest fused allreduce. Allreduces that are agreed in the same '
             'negotiation round and share process set, dtype, op, scale factors and '
             'joined ranks are packed into one buffer up to this many bytes and '
             'reduced in one transfer. `0` disables fusion. On one host '
             'with single-copy reads (`RONDE_CMA`), where no buffer is involved, the '
             'groups of one round run as one operation.'),
    Knob("bucket_bytes", "RONDE_BUCKET_BYTES", parse_bytes,
         accepted=_BYTES,
         default='`25MiB`', unit='bytes ([size syntax](#sizes))',
         doc='torch `DistributedOptimizer` on CPU tensors: from its third step on, '
             'gradients travel in buckets of at most this many bytes (the first '
             'one at most `RONDE_FIRST_BUCKET_BYTES`; one under a quarter of that '
             'joins the next, the last one the one before), '
             'laid out once in the order rank 0 saw them become ready, as '
             "DDP's `bucket_cap_mb`: each gradient is copied into its bucket by its "
             'hook and each bucket is one allreduce, so the per-tensor work of '
             'negotiation is paid per bucket. `0` reduces each gradient on its own '
             '(the path of the first two steps).'),
    Knob("first_bucket_bytes", "RONDE_FIRST_BUCKET_BYTES", parse_auto_bytes,
         default='`auto`', unit='`auto`, bytes ([size syntax](#sizes))',
         doc="The first gradient bucket's cap (DDP's `first_bucket_cap_mb`): small, so "
             'that its allreduce starts early and overlaps the rest of the backward '
             'pass. `auto`: 1 MiB, except in a one-host job whose ranks have no core '
             'to spare (as many ranks as cores, or more): there the reduction of a '
             "bucket is CPU work that can only take the backward pass's core, so the "
             'first bucket is as large as the others (`RONDE_BUCKET_BYTES`); measured '
             "with the ResNet of `python -m ronde.bench train` at np=2 on 2 cores: "
             'the same samples/s, 1.2 ms of CPU a step beyond a plain one against 3.2.'),
    Knob("bucket_views", "RONDE_GRADIENT_AS_BUCKET_VIEW", parse_bool,
         default='`1` (on)', unit='boolean',
         doc="DDP's `gradient_as_bucket_view`, on by default: once a parameter's "
             'gradient went into its bucket, `p.grad` becomes a view of the bucket, so '
             'the averaged gradient is in place after the allreduce (no copy back) and, '
             'when `zero_grad(set_to_none=False)` keeps the views, backward accumulates '
             'straight into the bucket (no copy in either). A `p.grad` kept from an '
             'earlier step changes with the bucket then. The same for '
             "`ShardedOptimizer(stage=1)`'s buffers (its `p.grad` stays this rank's own "
             'gradient, one copy of it instead of two). `0`: gradients are copied in '
             'and out and stay tensors of their own.'),
    Knob("sharded_in_flight", "RONDE_SHARDED_IN_FLIGHT", int,
         accepted=Range(1, 1 << 10),
         default='`1`', unit='buckets',
         doc="`ShardedOptimizer` (torch): the most buckets whose reduce-scatter is in "
             'flight at once; before it starts another, the optimizer waits for the oldest '
             '(every rank starts them in the same order). At stage 2 each bucket in flight '
             'holds a gradient buffer of `RONDE_BUCKET_BYTES`, and one more is being '
             'filled, so this bounds the memory above the formula: two buckets at the '
             'default. Backward goes on computing while the one in flight moves; `2` or '
             'more also queues the next behind it, at a bucket of memory each (measured '
             'at np=2 on 2 cores, `python -m ronde.bench memory`: the same step time at 1 '
             'and 2, 15-25 MB less peak growth at 1; at a cap of 1536 MiB, np=4, a '
             'model of 40 layers trains at 1 and is killed at 2 one run in two).'),
    Knob("sharded_flat_params", "RONDE_SHARDED_FLAT_PARAMS", parse_bool,
         default='`1` (on)', unit='boolean',
         doc="`ShardedOptimizer` (torch): each bucket's parameters become views of one "
             'flat buffer (as DDP\'s buckets and FSDP\'s flat parameters), so that the '
             'allgather after a step lands in the parameters themselves: no buffer of a '
             'bucket and no copy a step. A parameter whose `p.data` is replaced later is '
             'copied back in at the next step; another dtype, device or size is refused. '
             '`0`: the parameters keep their own memory and each step gathers into a '
             'pooled buffer and copies out of it.'),
    Knob("sharded_trim_heap", "RONDE_SHARDED_TRIM_HEAP", parse_bool,
         default='`1` (on)', unit='boolean',
         doc="`ShardedOptimizer` (torch): after a step that left glibc's heap larger than "
             'any step before, hand its free pages back to the system (`malloc_trim`): '
             'the blocks a step frees (autograd\'s gradients, the optimizer\'s '
             'temporaries) otherwise stay counted to the process, 50-120 MiB a rank at '
             '1.5 GiB, which is a memory cap\'s margin. A step that did not grow the heap '
             'costs one `mallinfo2` call. `0`: off. Nothing happens outside glibc.'),
    Knob("steady_lane", "RONDE_STEADY_LANE", parse_bool,
         default='`1` (on)', unit='boolean',
         doc='From its third agreement on, a gradient bucket of the global set skips '
             'negotiation where that set is on one host (`shm`): every rank checks in '
             "shared memory that the others bring the same bucket, and the lane's own "
             'thread runs it; any difference sends it back to negotiation (see '
             'architecture.md, "The steady lane"). `0`, or `RONDE_AUTOTUNE=1`: buckets '
             'are always negotiated.'),
    Knob("cycle_time_ms", "RONDE_CYCLE_TIME", float,
         accepted=Range(0, 60_000, above=True),
         default='`1.0`', unit='milliseconds',
         horovod=('HOROVOD_CYCLE_TIME',), flag='--cycle-time-ms MS',
         flag_note='must be > 0',
         doc='While the executor is busy moving data, how long newly submitted '
             'collectives may wait to be announced, so that tensors arriving meanwhile'
             ' are negotiated (and fused) together. A submission that wakes the idle '
             'engine is announced after a quarter of it, so that the rest of a burst '
             '(a loop of async calls) goes in the same round; a caller that waits '
             'drives the round at once.'),
    Knob("round_hold_ms", "RONDE_ROUND_HOLD", float,
         accepted=Range(0, 60_000),
         default='`50`', unit='milliseconds',
         doc='Between ranks of one host: how long a rank may keep announcements that '
             'complete nothing yet (no other rank announced those tensors) from starting '
             'a negotiation round, while its peers have nothing to announce. The last '
             'rank to want a round starts it, so a gradient bucket that the ranks reach '
             'milliseconds apart is agreed in one round instead of one per rank (each '
             'round wakes every rank). Holding never delays a collective: it cannot '
             'complete before the last rank announces it. `0`: announce at once, as '
             'Horovod does. Unset, a rank whose host has more ranks than cores holds '
             'this times its ranks per core (rounded up): ranks that share a core reach '
             'a bucket further apart.'),
    Knob("cache_capacity", "RONDE_CACHE_CAPACITY", int,
         accepted=Range(0, 1 << 20),
         default='`1024`', unit='entries',
         horovod=('HOROVOD_CACHE_CAPACITY',),
         doc='Size of the response cache: names whose metadata is remembered, so a '
             'repeated collective is announced as a small integer instead of its full '
             'metadata. `0` disables the cache.'),
    Knob("transport", "RONDE_TRANSPORT", str,
         default='`auto`', unit='`auto`, `tcp`, `shm`, `gloo`, `mpi`',
         flag='--transport {auto,tcp,shm,gloo,mpi}',
         flag_note='also `--tcp`, `--shm`, `--gloo`, and `--mpi` (which also launches '
                   'through `mpiexec`)',
         doc='Data transport of each process set. `auto`: shared memory when all '
             'members of the set are on one host and the machine is x86-64, '
             'hierarchical (shm within hosts, tcp across) when the set spans hosts '
             'with the same number (≥ 2) of members on each, tcp otherwise. `shm` '
             'forces shared memory (`ConfigError` at `init()` if the set spans hosts).'
             ' `tcp` forces sockets, also on one host. `gloo` moves the bytes through '
             "a torch.distributed Gloo process group (needs torch; ronde's "
             'negotiation, fusion and validation stay on top; reducescatter is an '
             'allreduce plus a slice there, and allgather pads blocks to the largest).'
             ' `mpi` moves them with MPI calls through mpi4py (the job must be started'
             ' by `mpirun`/`mpiexec`/`srun`, or by `ronderun --mpi`, so that MPI and '
             'ronde agree on ranks; float16/bfloat16 reductions use a numpy-backed '
             'user op). `ronderun --gloo/--tcp/--shm` are shorthands; `ronderun --mpi`'
             " also launches through the environment's `mpiexec`."),
    Knob("start_timeout_s", "RONDE_START_TIMEOUT", float,
         accepted=_SECONDS,
         default='`30`', unit='seconds',
         horovod=('HOROVOD_START_TIMEOUT',), flag='--start-timeout S',
         flag_note='always set for the workers (default `$RONDE_START_TIMEOUT`, else '
                   "`$HOROVOD_START_TIMEOUT`, else 30); also the launcher's own rendezvous"
                   ' timeout',
         doc='How long start-up may take: reaching the rendezvous and all ranks '
             "arriving there, connecting to every peer, the peers' shared-memory "
             'segments appearing, and then every peer on the host mapping them (a '
             'peer that dies during start-up fails the others within this time).'),
    Knob("stop_grace_s", "RONDE_STOP_GRACE", float,
         accepted=Range(0, 3600),
         default='`10`', unit='seconds',
         doc="When `ronderun` stops ranks (a peer failed, the job timed out, Ctrl-C, or "
             'the launcher died: see launcher.md), the seconds between a rank\'s SIGTERM '
             'and its SIGKILL. A rank inside `save_checkpoint` finishes its file in '
             'that time; other ranks die at the SIGTERM, so a long grace costs nothing.'),
    Knob("elastic_timeout_s", "RONDE_ELASTIC_TIMEOUT", float,
         accepted=_SECONDS,
         default='`600`', unit='seconds',
         horovod=('HOROVOD_ELASTIC_TIMEOUT',), flag='--elastic-timeout S',
         flag_note='must be > 0',
         doc='Elastic jobs: how long the launcher waits for `--min-np` slots (at start '
             'and after losing hosts) before failing the job; a worker waits as long, '
             'plus `RONDE_START_TIMEOUT`, for the next generation to form.'),
    Knob("reset_limit", "RONDE_RESET_LIMIT", int,
         accepted=Range(0, 1_000_000),
         default='`0`', unit='resets (`0`: no limit)',
         horovod=('HOROVOD_RESET_LIMIT',), flag='--reset-limit N',
         doc='Elastic jobs: fail once the job has re-formed this many times (counted by '
             'the launcher, and by each worker for its own resets).'),
    Knob("elastic_poll_s", "RONDE_ELASTIC_POLL", float,
         accepted=Range(0, 3600, above=True),
         default='`1.0`', unit='seconds',
         doc="Elastic jobs: how often each worker asks the launcher for host changes "
             "(a daemon thread; `commit()` reads the answer without a round trip)."),
    Knob("peer_timeout_s", "RONDE_PEER_TIMEOUT", float,
         accepted=_SECONDS,
         default='`10`', unit='seconds',
         doc='When a peer has not answered a negotiation round for this long, log a '
             'warning naming it ("is their Python process blocked?"). Only a warning.'),
    Knob("shutdown_timeout_s", "RONDE_SHUTDOWN_TIMEOUT", float,
         accepted=_SECONDS,
         default='`10`', unit='seconds',
         doc='At `shutdown()`, how long to wait for every rank to announce its '
             'shutdown, and then for agreed work to drain, before leaving anyway.'),
    Knob("stall_check_time_s", "RONDE_STALL_CHECK_TIME", float,
         accepted=_SECONDS_OR_0,
         default='`60`', unit='seconds',
         horovod=('HOROVOD_STALL_CHECK_TIME_SECONDS',), flag='--stall-check-warning-time-seconds S',
         flag_note='must be >= 0',
         doc='Rank 0 warns about a collective that some ranks submitted and others '
             'have not, once it has waited this long.'),
    Knob("stall_shutdown_time_s", "RONDE_STALL_SHUTDOWN_TIME", float,
         accepted=_SECONDS_OR_0,
         default='`300`', unit='seconds',
         horovod=('HOROVOD_STALL_SHUTDOWN_TIME_SECONDS',), flag='--stall-check-shutdown-time-seconds S',
         flag_note='must be >= 0 (but see the warning about 0)',
         doc='A stalled collective older than this fails with `StallError` on the '
             'ranks that submitted it. Also the longest a rank waits for a peer that '
             'answers no negotiation round, or moves no data in a collective, before '
             'raising `PeerLostError` naming it ("stopped responding", "alive but not '
             'taking part"). `0` means never (Horovod\'s meaning). A peer whose process'
             ' dies is reported at once, whatever this is; a host that vanishes '
             'without closing its connections within about 10 s (TCP keepalive).'),
    Knob("deadlock_time_s", "RONDE_DEADLOCK_TIME", float,
         accepted=_SECONDS_OR_0,
         default='`5`', unit='seconds',
         doc='Crossed collectives: a rank whose threads only wait on collectives '
             "(nothing submitted or completed, and the process's CPU idle) for this "
             'long tells its peers (again after another such period, if it still is); '
             'once every rank has said so twice in a row while collectives are '
             'pending, none of them can ever complete, and they fail on every rank '
             'with `DeadlockError` (pending barriers last: a rank that went on to a '
             'barrier is where the others arrive next). A rank still computing (CPU '
             'busy) or still moving agreed data never counts as waiting. `0` turns '
             "this off (then only the stall inspector's limits apply)."),
    Knob("stall_check_enabled", "RONDE_STALL_CHECK", parse_bool,
         default='`1` (on)', unit='boolean',
         horovod_shown='`HOROVOD_STALL_CHECK_DISABLE` (inverted)',
         doc='Turns the stall inspector (warnings and `StallError`) on or off. '
             '`HOROVOD_STALL_CHECK_DISABLE=1` turns it off.'),
    Knob("timeline_path", "RONDE_TIMELINE", parse_timeline_path,
         default='empty', unit='file path',
         horovod=('HOROVOD_TIMELINE',), flag='--timeline-filename FILE',
         flag_note='see [timeline.md](timeline.md)',
         doc='Write a Chrome-trace timeline (see [timeline.md](timeline.md)). Rank 0 '
             'writes the path as given (as Horovod does); with `{rank}` in the path '
             'every rank writes its own file. `DYNAMIC` (as in Horovod): no file until '
             'the script calls `start_timeline(path)`.'),
    Knob("timeline_mark_cycles", "RONDE_TIMELINE_MARK_CYCLES", parse_bool,
         default='`0`', unit='boolean',
         horovod=('HOROVOD_TIMELINE_MARK_CYCLES',),
         doc='Add an instant event for every negotiation round to the timeline.'),
    Knob("torchrun_env", "RONDE_TORCHRUN_ENV", parse_bool,
         default='`1`', unit='boolean',
         doc="Give workers torchrun's variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, "
             '`MASTER_ADDR`...): `ronderun` sets them at start, and `init()` for every '
             "launcher (see [launcher.md](launcher.md)), so trainers that read them "
             "(Lightning, Hugging Face) run distributed. `0`: neither does, e.g. for "
             "ronde's `DistributedOptimizer` inside a one-process Trainer loop."),
    Knob("bind_addr", "RONDE_BIND_ADDR", parse_bind_addr,
         default='empty', unit='IP address or host name',
         flag='--bind-addr ADDR',
         flag_note="also where the launcher's rendezvous service listens",
         doc="Address the worker's listening socket (peer connections) binds to, and "
             'that it advertises to its peers. Empty: `127.0.0.1` for a job on one '
             'host, else all interfaces (`0.0.0.0`) advertising the address that '
             'routes to the rendezvous host. Under `torchrun` it is also where rank 0 '
             "serves the rendezvous. `ronderun --bind-addr` also binds the launcher's "
             'rendezvous service there. A value that is neither an IP address nor a '
             'name that resolves is refused at start, naming it.'),
    Knob("open_startup", "RONDE_OPEN_STARTUP", parse_bool,
         default='`0` (off)', unit='boolean',
         doc='A job whose ranks span hosts, started by `torchrun` or `srun` (or '
             '`mpirun` without mpi4py) and given no secret (`RONDE_SECRET`, '
             '`RONDE_SECRET_FILE`), refuses to start on every rank unless this is '
             "`1`: then rank 0's rendezvous lets the first process to register each "
             'rank take it during start-up, and hands it the random secret made for '
             "the job: torch.distributed's own level of trust, see "
             '[security.md](security.md#open-start-up).'),
    Knob("shm_segment_bytes", "RONDE_SHM_SEGMENT", parse_bytes,
         accepted=Range(64 << 10, 64 * _GIB, size=True),
         default='`64MiB`', unit='bytes ([size syntax](#sizes))',
         doc="Data region of each rank's shared-memory segment (plus 192 KiB of header "
             'and small-message regions), per process set on the shm transport. '
             'Collectives larger than the segment run in pieces; a fused allreduce that '
             "fits is packed straight into it. Each rank maps every member's segment,"
             ' so a host uses about `local ranks x this` of `/dev/shm` memory per shm '
             "process set. The steady lane's own segment also holds torch's gradient "
             'buckets (those that fit, keeping 256 KiB for staging), reduced there in '
             'place: their gradients then live in `/dev/shm`. The memory is reserved '
             'when `init()` makes the segments (`posix_fallocate`: a full `/dev/shm` is '
             'never a SIGBUS later), about `local ranks x 2 x this` in a one-host job '
             '(the global set and the steady lane) plus 1 MiB a rank of negotiation '
             "mailboxes. Where a host's `/dev/shm` has less free, `init()` shrinks that "
             "host's segments to fit in half of its free space (down to 1 MiB), else "
             'runs the process sets with a rank there over tcp, and warns on its ranks '
             '([troubleshooting](troubleshooting.md#a-small-devshm)).'),
    Knob("small_allreduce_bytes", "RONDE_SMALL_ALLREDUCE", parse_bytes,
         accepted=_BYTES,
         default='`64KiB`', unit='bytes ([size syntax](#sizes))',
         doc='tcp transport only: allreduces up to this size use recursive doubling '
             '(fewer, larger messages: latency-bound), larger ones the ring '
             '(bandwidth-bound).'),
    Knob("inline_bytes", "RONDE_INLINE_BYTES", parse_bytes,
         accepted=_BYTES,
         default='`4096` (4 KiB)', unit='bytes',
         doc='A cached allreduce of at most this many bytes travels inside the '
             'negotiation message itself; every rank reduces all contributions '
             'locally, in rank order, so the whole collective costs one message '
             'exchange. Not when the same message carries a larger allreduce of the '
             'same reduction (process set, dtype, op, scales): then the small one '
             'fuses into that transfer. At most 256 KiB of inline data ride in one '
             'round. `0` turns it off.'),
    Knob("cma", "RONDE_CMA", parse_bool,
         default='`1`', unit='boolean',
         doc='Shared-memory transport: allreduces, allgathers, broadcasts, alltoalls '
             "and reducescatters of 256 KiB or more copy straight between the ranks' "
             'own buffers with Linux cross-memory attach (`process_vm_readv`, and '
             "`process_vm_writev` for the allreduce's gather where every rank may "
             'write), one copy instead of two and no fusion buffer. Where Yama '
             "restricts ptrace to descendants (`ptrace_scope` 1, Ubuntu's default) "
             'each rank allows same-user peers with `prctl(PR_SET_PTRACER, '
             'PR_SET_PTRACER_ANY)` at start-up (see troubleshooting.md). All ranks '
             'test it once, when their shared-memory communicator is made (at `init()`, '
             'or when a process set is added), and agree; if any rank is refused '
             'reads (Yama scope 2 or 3, a container without ptrace rights), every rank'
             " uses the shared segments; if only writes are refused, the allreduce's "
             "gather reads instead. The allreduce's blocks are sized by each owner's "
             'measured time (no knob). `0` turns it all off (and leaves the ptrace '
             'setting alone).'),
    Knob("hugepages", "RONDE_HUGEPAGES", parse_bool,
         default='`1`', unit='boolean',
         doc="With single-copy reads (`RONDE_CMA`): before peers read a rank's "
             'tensors, the rank moves the 2 MiB blocks of memory holding them onto '
             'transparent huge pages (`madvise(MADV_COLLAPSE)`, Linux 6.1+), each '
             'block once, the second time it is seen; peers then copy from it about 3x'
             ' faster (the kernel pins 4 KiB pages one by one). Contents are '
             "unchanged; a small tensor's neighbours in the same 2 MiB block move too;"
             ' a block is only moved when at least 90 % of it is resident already, so '
             'resident memory grows by at most a tenth of what moves. Nothing happens '
             'where the kernel lacks it or THP is `never`. Where it is in use, '
             "`init()` also sets glibc's malloc mmap threshold to 32 MiB and trim "
             'threshold to 64 MiB (`mallopt`: where glibc settles by itself once a '
             'program freed a block that large), so tensors allocated afterwards come '
             'from the heap, which can move onto huge pages, instead of mappings '
             'wedged between shared libraries, which cannot. `0` leaves memory and '
             'malloc alone (and keeps any `MADV_NOHUGEPAGE` you set).'),
    Knob("shm_control", "RONDE_SHM_CONTROL", parse_hierarchical,
         default='`auto`', unit='`auto`, boolean',
         doc='Negotiation frames between ranks on the same host (x86-64) go through '
             'shared-memory mailboxes instead of the control sockets (a round trip in '
             'well under a microsecond when the peer is awake, instead of ~50 us of '
             'system calls and wake-ups). The sockets still carry doorbells for '
             'sleeping peers, oversize frames and failure notices, and still report a '
             'dead peer. `auto`: mailboxes while the ranks on the host are no more '
             'than its cores (beyond that a rank waiting for a frame is better woken '
             'by the kernel when the frame arrives: measured 4-15x faster at 4-8 '
             'ranks on 2 cores); `1`: always; `0`: sockets only.'),
    Knob("coordinator_min", "RONDE_COORDINATOR_MIN", int,
         accepted=_RANKS,
         default='`3`', unit='ranks',
         doc='From this many ranks on (and where no same-host mailboxes carry the '
             'negotiation, see `RONDE_SHM_CONTROL`), each negotiation round goes through '
             'rank 0: every rank sends it its frame and receives one bundle of the round\'s '
             'frames back, each distinct frame once with a bit mask of its senders (3(N-1)'
             ' messages a round instead of N(N-1); every rank still decides from the '
             'same frames; `init()` opens N - 1 control sockets instead of N(N-1)/2). Below it, frames go all-to-all (one hop: faster for few '
             'ranks: measured faster at 2 ranks, slower from 3). `0`: always '
             'all-to-all.'),
    Knob("coordinator_tree_min", "RONDE_COORDINATOR_TREE", int,
         accepted=_RANKS,
         default='`128`', unit='ranks',
         doc='From this many ranks on, rounds that go through the coordinator (see '
             '`RONDE_COORDINATOR_MIN`) travel over a binomial tree rooted at rank 0 '
             'instead of a star: each rank merges its children\'s grouped frames with '
             'its own and sends them to its parent, and forwards the bundle down, so no '
             'rank handles more than 1 + log2 N frames a round (the star: rank 0 handles '
             '2(N - 1)), at 2 log2 N hops a round instead of 2. Back to the star for the '
             'rest of the job once a rank shuts down. The default is where the '
             'modelled round of `python -m ronde.bench control` (rank 0\'s measured '
             'work with its system calls, 25 us a hop) favours the tree: 0.8x the '
             'star at 64 ranks, 2x at 256, 5.7x at 1024. `0`: never.'),
    Knob("spin_time_us", "RONDE_SPIN_TIME", float,
         accepted=Range(0, 10_000_000),
         default='`200`', unit='microseconds',
         doc='How long a thread waiting on a handle keeps *driving* the engine '
             '(running the next negotiation round and the agreed collectives itself, '
             'see architecture.md) and polling before it sleeps; also how long a round'
             " polls a same-host peer's mailbox before sleeping in `select`. Polling "
             'yields the CPU and the GIL. `0`: callers never drive or poll; the '
             "engine's threads do all the work (two thread hand-offs per collective, "
             '~3x the latency of small ones where every rank has a core). Unset, a rank '
             'whose host has more ranks than cores uses `0`: a poller there takes the '
             'core its peer needs (architecture.md, "Waiting callers drive").'),
    Knob("torch_device_path", "RONDE_TORCH_DEVICE_PATH", str,
         default='`auto`', unit='`auto`, `always`, `never`',
         doc='`ronde.torch`: `auto` keeps CUDA tensors on the GPU (allreduce and '
             'broadcast, through a NCCL group per process set) when NCCL is available '
             'and every member of the set has a GPU of its own (ranks sharing a GPU '
             'stage through page-locked host memory, with one warning); `always` also '
             'sends CPU tensors through that path with Gloo (how it is tested without '
             'GPUs); `never` copies device tensors to the host for every collective.'),
    Knob("hierarchical", "RONDE_HIERARCHICAL_ALLREDUCE", parse_hierarchical,
         default='`auto`', unit='`auto`, `1`/`on`, `0`/`off`',
         horovod=('HOROVOD_HIERARCHICAL_ALLREDUCE',),
         doc='For a process set spanning several hosts with the same number (≥ 2) of '
             'members on each: allreduce as a shared-memory reduce-scatter within each'
             ' host, a tcp ring across hosts, and a shared-memory allgather. `auto` '
             'and `on` use it whenever the layout allows; `off` always uses the flat '
             'tcp ring.'),
    Knob("autotune", "RONDE_AUTOTUNE", parse_bool,
         default='`0`', unit='boolean',
         horovod=('HOROVOD_AUTOTUNE',), flag='--autotune',
         doc='Tune `RONDE_FUSION_THRESHOLD`, `RONDE_CYCLE_TIME`, `RONDE_INLINE_BYTES` and '
             '`RONDE_SPIN_TIME` online from the bytes reduced per second (see '
             '[autotune.md](autotune.md)); rank 0 decides, every rank applies the same '
             'values at the same negotiation round. A knob set explicitly is left alone.'),
    Knob("autotune_log", "RONDE_AUTOTUNE_LOG", str,
         default='empty', unit='file path',
         horovod=('HOROVOD_AUTOTUNE_LOG',), flag='--autotune-log-file FILE',
         doc='Autotune: rank 0 writes a CSV here, a header, one row per sample and the '
             'best values last.'),
    Knob("autotune_warmup_samples", "RONDE_AUTOTUNE_WARMUP_SAMPLES", int,
         accepted=Range(0, 10_000),
         default='`3`', unit='samples',
         horovod=('HOROVOD_AUTOTUNE_WARMUP_SAMPLES',), flag='--autotune-warmup-samples N',
         doc='Autotune: samples discarded at the start (warm-up).'),
    Knob("autotune_steps_per_sample", "RONDE_AUTOTUNE_STEPS_PER_SAMPLE", int,
         accepted=Range(1, 1_000_000),
         default='`10`', unit='steps',
         horovod=('HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE',), flag='--autotune-steps-per-sample N',
         doc='Autotune: training steps per sample (a step ends when a tensor name comes '
             'again); the score is the median over its steps.'),
    Knob("autotune_bayes_opt_max_samples", "RONDE_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", int,
         accepted=Range(1, 10_000),
         default='`20`', unit='samples',
         horovod=('HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES',),
         flag='--autotune-bayes-opt-max-samples N',
         doc='Autotune: samples of the Bayesian search over fusion threshold and cycle '
             'time (the configured values and 3 test points among them).'),
    Knob("autotune_gaussian_process_noise", "RONDE_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", float,
         accepted=Range(0, 1000, above=True),
         default='`0.8`', unit='(relative to the scores\' variance)',
         horovod=('HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE',),
         flag='--autotune-gaussian-process-noise X',
         doc='Autotune: the noise term (alpha) of the Gaussian process, on standardised '
             'scores; larger trusts single samples less.'),
    Knob("log_level", "RONDE_LOG_LEVEL", str,
         default="empty (the logger's level is left alone)", unit='level name',
         horovod=('HOROVOD_LOG_LEVEL',), flag='--log-level LEVEL',
         doc='Level of the `ronde` logger: `DEBUG`, `INFO`, `WARNING`, `ERROR` '
             '(case-insensitive). An unknown name is a `ConfigError` naming the '
             'variable.'),
)

#: set by a launcher (ronderun, the testing helpers) for its workers, not by users
LAUNCHER_VARIABLES = frozenset({
    "RONDE_RANK", "RONDE_SIZE", "RONDE_LOCAL_RANK", "RONDE_LOCAL_SIZE", "RONDE_CROSS_RANK",
    "RONDE_CROSS_SIZE", "RONDE_HOSTNAME", "RONDE_SECRET", "RONDE_RENDEZVOUS_ADDR",
    "RONDE_RENDEZVOUS_PORT", "RONDE_JOB_ID", "RONDE_LAUNCHER", "RONDE_REMOTE_SHELL",
    "RONDE_TESTING_FN", "RONDE_TESTING_DIR", "RONDE_TESTING_PRELOAD", "RONDE_ELASTIC",
    "RONDE_SLOT", "RONDE_NODE", "RONDE_LAUNCHER_FD", "RONDE_TORCHRUN_SET",
    # the secret as a file (runner/env.py reads it with RONDE_SECRET: not a knob)
    "RONDE_SECRET_FILE",
    # read by scripts/ and tests, not by ronde: a setting of theirs is no typo
    "RONDE_MXNET_CORE", "RONDE_MXNET_VENV", "RONDE_MXNET_PYTHON", "RONDE_FAKE_HOST"})
