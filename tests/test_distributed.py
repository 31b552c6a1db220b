"""Communication layer, launcher and mesh: byte accounting, failures that must not hang."""

import subprocess
import sys
import time

import pytest
import torch

import torchtsp
from torchtsp.distributed import AxisComm, RankFailedError, WorkerPool


def every_op_on_rank(world, point_to_point=None):
    mesh = torchtsp.init_mesh(tsp=world)
    comm = AxisComm.from_mesh(mesh, "tsp")
    if point_to_point is not None:  # gloo's own collectives (as on NCCL) or the point-to-point versions
        comm = AxisComm(comm.group, "tsp", point_to_point=point_to_point)
    r, n = comm.rank, 6  # 6 float32 elements = 24 bytes per rank
    x = torch.full((n,), float(r))
    out = {}
    with comm.counting() as stats:
        out["broadcast"] = comm.broadcast(x.clone(), src=world - 1)
        out["all_gather"] = comm.all_gather(x)
        out["reduce_scatter"] = comm.reduce_scatter(torch.ones(world, n) * (r + 1))
        out["reduce"] = comm.reduce(x.clone(), dst=0)
        out["all_reduce"] = comm.all_reduce(x.clone())
        out["ring_shift"] = comm.ring_shift(x)
        # Slice s of rank r's input is 10r + s: rank r receives 10s + r from rank s, into a reused buffer.
        slices = torch.stack([torch.full((n,), 10.0 * r + s) for s in range(world)])
        buffer = torch.empty(world, n)
        out["all_to_all"] = comm.all_to_all(slices, out=buffer)
        out["all_to_all_in_buffer"] = out["all_to_all"].data_ptr() == buffer.data_ptr()
        out["all_gather_into"] = comm.all_gather(x, out=torch.empty(world, n))
        pending = comm.all_reduce(torch.ones(n), async_op=True)
        comm.mark("compute")
        out["async"] = pending.wait()
    return out, dict(stats.bytes_recv), dict(stats.bytes_sent), [e[:2] for e in stats.events]


@pytest.mark.parametrize("point_to_point", [None, False], ids=["default", "gloo_collectives"])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_operation_moves_and_counts_the_right_bytes(pools, world, point_to_point):
    nbytes = 24
    total = sum(range(world))
    for r, (out, recv, sent, events) in enumerate(pools(world).run(every_op_on_rank, world, point_to_point)):
        assert torch.equal(out["broadcast"], torch.full((6,), float(world - 1)))
        assert torch.equal(out["all_gather"], torch.arange(world).float()[:, None].expand(world, 6))
        assert torch.equal(out["reduce_scatter"], torch.full((6,), float(sum(range(1, world + 1)))))
        if r == 0:
            assert torch.equal(out["reduce"], torch.full((6,), float(total)))
        assert torch.equal(out["all_reduce"], torch.full((6,), float(total)))
        assert torch.equal(out["ring_shift"], torch.full((6,), float((r - 1) % world)))
        assert torch.equal(out["all_to_all"], (10.0 * torch.arange(world) + r)[:, None].expand(world, 6))
        assert out["all_to_all_in_buffer"]
        assert torch.equal(out["all_gather_into"], out["all_gather"])
        assert torch.equal(out["async"], torch.full((6,), float(world)))
        D = world
        assert recv["broadcast"] == (0 if r == D - 1 else nbytes * (D > 1))
        assert sent["broadcast"] == ((D - 1) * nbytes if r == D - 1 else 0)
        assert recv["all_gather"] == sent["all_gather"] == 2 * (D - 1) * nbytes  # into a new and a given buffer
        assert recv["all_to_all"] == sent["all_to_all"] == (D - 1) * nbytes
        assert recv["reduce_scatter"] == (D - 1) * nbytes
        assert recv["reduce"] == ((D - 1) * nbytes if r == 0 else 0)
        assert sent["reduce"] == (0 if r == 0 else nbytes)
        assert recv["all_reduce"] == 2 * 2 * (D - 1) * nbytes // D  # two all-reduces (sync + async)
        assert recv["ring_shift"] == (nbytes if D > 1 else 0)
        # The async all-reduce was issued, then the compute mark, then the wait.
        assert events[-3:] == [("issue", "all_reduce"), ("mark", "compute"), ("wait", "all_reduce")]


def prefix_ops_on_rank(world, point_to_point=None):
    """The causally pruned gather and its adjoint reduce-scatter (``prefix``: 2 of 4 rows), on rank-coded data."""
    mesh = torchtsp.init_mesh(tsp=world)
    comm = AxisComm.from_mesh(mesh, "tsp")
    if point_to_point is not None:
        comm = AxisComm(comm.group, "tsp", point_to_point=point_to_point)
    r, prefix = comm.rank, (1, 2)
    x = torch.arange(2 * 4 * 3, dtype=torch.float32).view(2, 4, 3) + 100 * r  # [2, 4, 3]: dim 1 cut to 2
    with comm.counting() as stats:
        gathered = comm.all_gather_prefixes(x, prefix, async_op=True).wait()
        # Slices for earlier ranks cut to the prefix (their gradient is zero past it), as the attention makes them.
        slices = [torch.full((2, 2 if s < r else 4, 3), float(1 + r + 10 * s)) for s in range(world)]
        summed = comm.reduce_scatter(slices, prefix=prefix)
        padded = torch.zeros(world, 2, 4, 3)  # the same slices in one tensor, zero past a cut slice's prefix
        for s, part in enumerate(slices):
            padded[s, :, :part.shape[1]] = part
        whole = comm.reduce_scatter(padded, prefix=prefix)
    return gathered, summed, whole, dict(stats.bytes_recv), dict(stats.bytes_sent)


@pytest.mark.parametrize("point_to_point", [None, False], ids=["default", "gloo_collectives"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_prefix_gather_and_scatter_move_only_what_later_ranks_need(pools, world, point_to_point):
    """``all_gather_prefixes``: a rank gets the first part of earlier ranks' tensors and all of later ones';
    ``reduce_scatter(prefix=...)`` is its adjoint (from later ranks only the first part comes back). Bytes per
    rank follow ``kv_exchange_halves``; a collective backend moves everything."""
    from torchtsp.analysis.comm_model import kv_exchange_halves

    half = 2 * 2 * 3 * 4  # bytes of a [2, 2, 3] float32 first part: half of a rank's tensor
    for r, (gathered, summed, whole, recv, sent) in enumerate(pools(world).run(prefix_ops_on_rank, world,
                                                                                 point_to_point)):
        pruned = point_to_point is None and world > 1
        for s, part in enumerate(gathered):
            full = torch.arange(24, dtype=torch.float32).view(2, 4, 3) + 100 * s
            assert torch.equal(part, full[:, :2] if pruned and s < r else full), (r, s)
        # Rank r's slice summed over ranks s, where later ranks (s > r) contributed only its first two rows.
        expected = torch.full((2, 4, 3), float(sum(1 + s + 10 * r for s in range(r + 1))))
        expected[:, :2] += sum(1 + s + 10 * r for s in range(r + 1, world))
        assert torch.equal(summed, expected), r
        assert torch.equal(whole, expected), r  # a whole [D, ...] input is cut the same way
        gather, scatter = kv_exchange_halves(world, r if pruned else None)
        assert recv.get("all_gather", 0) == gather * half
        assert recv.get("reduce_scatter", 0) == 2 * scatter * half  # two reduce-scatters
        # Sent plus received per exchange: 3(D-1) halves pruned instead of 4(D-1), the same on every rank.
        assert recv.get("all_gather", 0) + sent.get("all_gather", 0) == (3 if pruned else 4) * (world - 1) * half


def exchange_on_rank(world, point_to_point=None):
    """``AxisComm.exchange``: rank r sends r + 1 rows of value 10r + s to each rank s it sends to (every other
    rank after it, wrapping), on two channels in flight at once, the second one's sends issued first."""
    comm = AxisComm.from_mesh(torchtsp.init_mesh(tsp=world), "tsp")
    if point_to_point is not None:
        comm = AxisComm(comm.group, "tsp", point_to_point=point_to_point)
    r = comm.rank
    targets = [s for s in range(world) if s != r and (s - r) % world <= max(1, world - 2)]
    sources = [s for s in range(world) if s != r and (r - s) % world <= max(1, world - 2)]
    with comm.counting() as stats:
        pending = []
        for channel in (1, 0):
            sends = [(torch.full((r + 1, 3), 10.0 * r + s + 100 * channel), s) for s in targets]
            recvs = [(torch.empty(s + 1, 3), s) for s in sources]
            pending.append(comm.exchange(sends, recvs, async_op=True, channel=channel, finish=lambda out: out[::-1]))
        got = [p.wait() for p in pending]
        nothing = comm.exchange([], [])
        try:
            comm.exchange([(torch.ones(1), r)], [])
        except ValueError as e:
            refused = str(e)
    return got, sources, nothing, refused, dict(stats.bytes_recv), dict(stats.bytes_sent)


@pytest.mark.parametrize("point_to_point", [None, False], ids=["default", "gloo_collectives"])
@pytest.mark.parametrize("world", [2, 4])
def test_exchange_moves_each_pair_its_tensors_and_counts_them(pools, world, point_to_point):
    """Point-to-point exchanges of uneven sizes (a sliding layer's K/V) pair up per channel, the ``finish`` runs
    on what arrived, an empty exchange moves nothing, a rank cannot send to itself; bytes are what moved."""
    for r, (got, sources, nothing, refused, recv, sent) in enumerate(pools(world).run(exchange_on_rank, world,
                                                                                       point_to_point)):
        for channel, buffers in zip((1, 0), got):
            for buffer, s in zip(buffers[::-1], sources):
                assert torch.equal(buffer, torch.full((s + 1, 3), 10.0 * s + r + 100 * channel)), (r, s, channel)
        assert nothing == [] and "need distinct other ranks" in refused
        assert recv["exchange"] == 2 * sum(12 * (s + 1) for s in sources)
        assert sent["exchange"] == 2 * 12 * (r + 1) * len(sources)  # as many targets as sources


def overlapping_ops_on_rank(world):
    """Several transfers of different kinds and sizes in flight on one group at once, waited out of order."""
    comm = AxisComm.from_mesh(torchtsp.init_mesh(tsp=world), "tsp")
    r = comm.rank
    pending = [comm.all_gather(torch.full((5,), float(r)), async_op=True),
               comm.reduce_scatter(torch.full((world, 3), float(r)), async_op=True),
               comm.all_gather(torch.full((2, 2), float(10 + r)), async_op=True),
               comm.broadcast(torch.full((4,), float(r)), src=1, async_op=True),
               comm.reduce(torch.full((7,), float(r)), dst=world - 1, async_op=True)]
    return [p.wait() for p in reversed(pending)][::-1]


def test_transfers_in_flight_together_pair_up_in_issue_order(pools):
    world = 4
    for r, (gathered, scattered, gathered2, broadcast, reduced) in enumerate(pools(world).run(
            overlapping_ops_on_rank, world)):
        assert torch.equal(gathered, torch.arange(world).float()[:, None].expand(world, 5))
        assert torch.equal(scattered, torch.full((3,), float(sum(range(world)))))
        assert torch.equal(gathered2, (10 + torch.arange(world).float())[:, None, None].expand(world, 2, 2))
        assert torch.equal(broadcast, torch.full((4,), 1.0))
        if r == world - 1:
            assert torch.equal(reduced, torch.full((7,), float(sum(range(world)))))


def raise_on_rank_one():
    if torch.distributed.get_rank() == 1:
        raise RuntimeError("boom on rank 1")
    # Rank 0 waits in a collective its peer never joins: the pool must not hang on it.
    AxisComm(torch.distributed.group.WORLD, "world").all_reduce(torch.ones(1))


def test_a_failing_rank_fails_the_job_loudly_without_hanging():
    start = time.monotonic()
    with pytest.raises(RankFailedError, match="boom on rank 1"):
        torchtsp.spawn(raise_on_rank_one, 2, timeout_s=60)
    assert time.monotonic() - start < 50


def wait_for_absent_peer():
    comm = AxisComm(torch.distributed.group.WORLD, "world", timeout_s=3)
    if comm.rank == 0:
        comm.broadcast(torch.ones(1), src=1)  # rank 1 never sends
    else:
        time.sleep(20)


def test_a_collective_whose_peer_never_comes_times_out():
    start = time.monotonic()
    with WorkerPool(2, timeout_s=60) as pool, pytest.raises(RankFailedError, match="rank 0 raised"):
        pool.run(wait_for_absent_peer)
    assert time.monotonic() - start < 18  # the 3 s collective timeout fired, not the sleeping peer


def test_init_mesh_without_a_launcher_is_a_one_rank_mesh():
    code = ("import torchtsp; m = torchtsp.init_mesh(); print(m.mesh_dim_names, m.size());"
            "import sys\ntry:\n torchtsp.init_mesh(tsp=2)\nexcept ValueError as e: print(e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert "('dp', 'sp', 'tp', 'tsp') 1" in out.stdout
    assert "needs 2 ranks but the world has 1" in out.stdout


@pytest.mark.parametrize("bad", [dict(tsp=0), dict(dp=-1), dict(tp=1.5)])
def test_init_mesh_rejects_non_positive_degrees(bad):
    with pytest.raises(ValueError, match="must be a positive integer"):
        torchtsp.init_mesh(**bad)


def test_nested_counting_blocks_each_see_their_own_traffic():
    comm = AxisComm(None, "solo")
    with comm.counting() as outer:
        with comm.counting() as inner:
            comm.mark("inner")
        comm.mark("outer")
    assert [e[2] for e in outer.events] == ["inner", "outer"] and [e[2] for e in inner.events] == ["inner"]
