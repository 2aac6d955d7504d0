"""What a spec will cost before it runs: bytes, store requests and money at list prices.

The exchange of one round is the all-reduce of `diloco_replica.round.allreduce`, whose traffic is
fixed by the protocol: per replica and lane, N−1 shards up plus one reduced shard, N−1
contributions and N−1 reduced shards down, and a fixed handful of requests around them. This
module counts them the same way the replicas' rows do (`RoundMetrics.bytes_up/bytes_down/
requests`), so the estimate can be checked against a run, and the run's `diloco status` shows
both. What depends on timing is kept apart: `polls` (re-checks while a replica waits for the
others, at most one per `poll_max` seconds of waiting, a reducer's looks for repair requests
among them) and deletes (free on S3, and one request per 1,000 keys there).

Outside the exchange a run also writes a metrics row per replica and round, one summary per
round, and every `checkpoint_every` rounds a checkpoint of θ and the outer momentum (8 bytes
per parameter across the replicas); those are counted in the run's totals as `bookkeeping`.

Prices come from ``prices.toml`` beside this module, one table per cloud (each with its date and
source), chosen by the rendezvous URI's scheme, with the file named by DILOCO_PRICES over it.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from ..errors import UserError
from ..store.runkeys import CHECKPOINT_PIECE_VALUES
from ..store.wiresize import MARKER_NBYTES, MEMBERS_NBYTES, OBJECT_OVERHEAD, Traffic, expected_payload_nbytes, parts_per_shard

ENV_PRICES = "DILOCO_PRICES"
ROW_NBYTES = 1500  # one replica's metrics row for a round (JSON)


def cloud_of(uri: str | None) -> str:
    """The cloud whose prices apply to a store URI (a local store is priced as the same run on aws)."""
    from ..store.objectstore import CLOUD_SCHEMES, scheme_of

    return CLOUD_SCHEMES.get(scheme_of(uri), "aws")


def load_prices(cloud: str = "aws") -> dict[str, Any]:
    """`cloud`'s price table: the packaged one, with DILOCO_PRICES's keys over it (its top-level
    keys for whatever cloud is priced, its [<cloud>] table's for that cloud only)."""
    tables = tomllib.loads(resources.files("diloco").joinpath("prices.toml").read_text())
    prices = {**tables[cloud], "cloud": cloud}
    path = os.environ.get(ENV_PRICES)
    if path:
        try:
            override = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise UserError(f"{ENV_PRICES} names {path!r}, which does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise UserError(f"{ENV_PRICES} file {path!r} is not valid TOML: {exc}") from None
        layers = [{k: v for k, v in override.items() if k not in tables}, override.get(cloud) or {}]
        for layer in layers:
            for key, value in layer.items():
                if isinstance(value, dict) and isinstance(prices.get(key), dict):
                    prices[key] = {**prices[key], **value}
                else:
                    prices[key] = value
        prices["source"] = f"{path} over the packaged table ({override.get('source', 'no source given')})"
    for table in ("requests", "transfer"):
        for key, value in prices.get(table, {}).items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise UserError(f"price `{table}.{key}` must be a non-negative number, got {value!r}")
    return prices


@dataclass
class Estimate:
    replicas: int
    lanes: int         # processes per replica (all its nodes'); where groups differ, the most (the figures' bound)
    fewest_lanes: int  # where groups differ, the fewest (else = lanes)
    transport: str
    fragments: int
    sync_every: int
    parameters: int | None
    parameters_from: str | None          # "spec" | "measured" | None
    total_steps: int | None
    rounds: int | None
    round: Traffic | None = None         # one replica, one round, the exchange (what its row counts)
    first_round: Traffic | None = None   # round 1: no repair check, nothing to delete yet
    run: Traffic | None = None           # every replica, every round, exchange + bookkeeping
    bookkeeping: Traffic | None = None   # metrics rows, summaries, checkpoints (in `run`)
    cost: dict[str, float] = field(default_factory=dict)
    poll_max: float = 1.0
    prices: dict[str, Any] = field(default_factory=dict)
    rendezvous: str | None = None
    groups: list[GroupCost] = field(default_factory=list)  # a run with [[group]] tables: each group's share
    nodes: list[int] = field(default_factory=lambda: [1])  # the machines per replica of the run's groups, distinct

    def per_node(self, nodes: int) -> Traffic | None:
        """One node's share of a replica's round: its lanes carry 1/K of the replica's bytes (each
        node's network card its own share), and their requests."""
        if self.round is None:
            return None
        return self.round.times(1 / nodes)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("round", "first_round", "run", "bookkeeping"):
            t = getattr(self, key)
            if t is not None:
                out[key]["requests"] = t.request_count
        return out


@dataclass
class GroupCost:
    """One replica group's share of the run: its reads of the store priced by where it runs.

    `place` is where its replicas read the store from (same_region, cross_region, internet: the
    keys of the price table's `transfer`), and `why` says how that was decided."""

    group: str
    backend: str
    replicas: int
    region: str | None
    place: str
    why: str
    bytes_down: float | None = None       # the whole run's, every replica of the group
    requests_cost: float | None = None
    transfer_cost: float | None = None


def backend_cloud(name: str) -> str | None:
    """The cloud a backend's replicas run in (`Capabilities.cloud`), or None; from the plugin's
    class, so no executor (and no cloud SDK) is built to price a run."""
    try:
        from ..plugins.discovery import get_backend

        caps = getattr(get_backend(name).cls, "capabilities", None)
    except UserError:
        return None
    return getattr(caps, "cloud", None)


def placement(group: Any, store_uri: str | None, store_region: str | None,
              run_region: str | None = None) -> tuple[str, str]:
    """Where `group` (a `diloco.spec.groups.ReplicaGroup`) reads the store from, and why. Its region:
    the group's own `region`, else its backend's `region` option (where it submits), else the
    run's top-level `region`."""
    cloud = backend_cloud(group.backend)
    store_cloud = cloud_of(store_uri)
    option = group.backend_options.get("region")
    region = group.region or (option if isinstance(option, str) else None) or run_region
    if cloud != store_cloud:
        return "internet", f"{group.backend} runs outside {store_cloud}"
    if not region or not store_region:
        return "cross_region", "region unknown: priced as another region; set `region` and `store_region`"
    if region == store_region:
        return "same_region", f"{region}, the store's region"
    return "cross_region", f"{region}, the store is in {store_region}"


def exchange(n: int, lanes: int, numel: int, transport: str, density: float, *, part_mb: float,
             first: bool = False, bulk_delete: int = 1) -> Traffic:
    """One replica's all-reduce traffic for a round syncing `numel` elements, its `lanes` together.

    A round is N·P shards of the whole vector (`parts_per_shard`), whatever a replica's lanes;
    each lane sends its piece of every shard it holds (a replica's own shards stay with the lane
    reducing them) and reads the means of the shards it overlaps. Each of the L − 1 lane
    boundaries may cut a shard in two: one more piece sent, and one more part read by the two
    lanes beside it (counted here, so the figure is exact for one lane and an upper bound for
    several). `first`: the run's first round (or the first after a rejoin): the replica checks
    whether the round was decided or collected without it (a GET of members.json, a LIST of the
    low-water mark), which a replica fresh from the previous round skips, and has nothing to
    delete or to look for repairs of yet. `bulk_delete`: keys one delete request takes on the store.
    """
    parts = parts_per_shard(numel, n, part_mb)
    cuts = lanes - 1  # lane boundaries, each splitting at most one shard
    part = numel / n / parts
    scatter = OBJECT_OVERHEAD + expected_payload_nbytes(round(part), transport, density=density)
    reduced = OBJECT_OVERHEAD + expected_payload_nbytes(round(part), transport, density=density, union_of=n)
    loser = (n - 1) / n  # every replica tries to write members.json; all but one read the winner's
    reducing = min(lanes, parts)  # lanes of this replica that reduce one of its parts (each deletes its inputs)
    return Traffic(
        bytes_up=parts * ((n - 1) * scatter + reduced) + cuts * OBJECT_OVERHEAD + MARKER_NBYTES + MEMBERS_NBYTES,
        bytes_down=parts * (n - 1) * (scatter + reduced) + cuts * reduced + loser * MEMBERS_NBYTES,
        puts=parts * (n - 1) + cuts + 1 + 1 + parts,              # pieces, ready marker, members.json, reduced parts
        gets=(1 if first else 0) + loser + 2 * parts * (n - 1) + cuts,  # [members.json, absent], the winner's,
        lists=(1 if first else 0) + 2 + lanes + (0 if first else lanes),  # pieces in, means; [low-water], ready,
        deletes=0 if first else reducing * -(-(n - 1) * parts // (reducing * bulk_delete)))  # roster; reduced; repairs


def estimate(spec: Any, *, parameters: int | None = None, parameters_from: str | None = None,
             prices: dict[str, Any] | None = None, rendezvous: str | None = None) -> Estimate:
    """The estimate for `spec` (a `RunSpec`); `parameters` overrides the spec's [diloco] parameters,
    `rendezvous` the spec's store (the one the run really uses, when a default chose it)."""
    d = spec.diloco
    uri = rendezvous or spec.rendezvous
    if parameters is None and d.get("parameters"):
        parameters, parameters_from = int(d["parameters"]), "spec"
    # the most processes any group's replicas run: its lane boundaries cut the most pieces (an upper bound)
    n, k = spec.replicas, int(d["fragments"])
    counts = [max(1, int(g.processes_per_replica)) * max(1, int(g.nodes)) for g in spec.replica_groups()]
    lanes = max(counts)
    total = d.get("total_steps")
    rounds = None if total is None else int(total) // (int(d["sync_every"]) // k)
    from ..store.objectstore import poll_defaults

    est = Estimate(replicas=n, lanes=lanes, fewest_lanes=min(counts), transport=d["transport"], fragments=k, sync_every=int(d["sync_every"]),
                   parameters=parameters, parameters_from=parameters_from if parameters else None,
                   total_steps=total, rounds=rounds,
                   prices=prices if prices is not None else load_prices(cloud_of(uri)),
                   poll_max=float(d.get("poll_max") or poll_defaults(uri)[1]), rendezvous=uri,
                   nodes=sorted({max(1, int(g.nodes)) for g in spec.replica_groups()}))
    if not parameters:
        return est
    numel = parameters / k
    density = float(d["topk_density"])
    from ..store.objectstore import BULK_DELETE, CLOUD_SCHEMES, scheme_of

    bulk = BULK_DELETE.get(CLOUD_SCHEMES.get(scheme_of(uri), ""), 1)  # local: one delete a key
    est.round = exchange(n, lanes, numel, d["transport"], density, part_mb=float(d["part_mb"]),
                         bulk_delete=bulk)
    est.first_round = exchange(n, lanes, numel, d["transport"], density, part_mb=float(d["part_mb"]),
                               first=True, bulk_delete=bulk)
    if rounds:
        ckpts = -(-rounds // int(d["checkpoint_every"]))  # every checkpoint_every rounds, and the last round
        summary = OBJECT_OVERHEAD + n * ROW_NBYTES
        # a checkpoint: N shards, cut where lanes are and at every CHECKPOINT_PIECE_VALUES values
        pieces = n + lanes - 1 + parameters // CHECKPOINT_PIECE_VALUES
        est.bookkeeping = Traffic(
            bytes_up=rounds * (n * ROW_NBYTES + summary) + ckpts * (8 * parameters + pieces * OBJECT_OVERHEAD),
            bytes_down=rounds * (n * ROW_NBYTES + n * summary),     # the recorder reads rows; everyone the summary
            puts=rounds * (n + 1) + ckpts * pieces,
            gets=rounds * (n + n),
            lists=rounds * (1 + n))
        exchanges = est.first_round.plus(est.round.times(rounds - 1)).times(n) if rounds else Traffic()
        est.run = exchanges.plus(est.bookkeeping)
        est.cost = price(est.run, est.prices)
    if spec.groups or spec.store_region or spec.region:
        est.groups = group_costs(spec, est)  # where each group reads the store from, when the spec says
    return est


def group_costs(spec: Any, est: Estimate) -> list[GroupCost]:
    """Each group's share of the run (its replicas' part of the requests and the reads), with the
    reads priced at the rate for where the group runs against the store."""
    out = []
    for g in spec.replica_groups():
        place, why = placement(g, est.rendezvous, spec.store_region, spec.region)
        cost = GroupCost(group=g.name, backend=g.backend, replicas=g.replicas, region=g.region, place=place, why=why)
        if est.run is not None:
            share = g.replicas / est.replicas
            cost.bytes_down = est.run.bytes_down * share
            cost.requests_cost = est.cost["requests"] * share
            cost.transfer_cost = price(Traffic(bytes_down=cost.bytes_down), est.prices).get(f"transfer_{place}", 0.0)
        out.append(cost)
    return out


def price(t: Traffic, prices: dict[str, Any]) -> dict[str, float]:
    """Dollars for requests, and for reading `t.bytes_down` out of the store from each place."""
    req = prices.get("requests", {})
    out = {"requests": (t.puts * req.get("put", 0) + t.lists * req.get("list", 0) + t.gets * req.get("get", 0)
                        + t.deletes * req.get("delete", 0)) / 1000}
    for where, per_gb in prices.get("transfer", {}).items():
        out[f"transfer_{where}"] = t.bytes_down / 1e9 * per_gb
    return out


def _size(x: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if x >= scale:
            return f"{x / scale:,.1f} {unit}"
    return f"{x:,.0f} B"


def format_groups(e: Estimate) -> list[str]:
    """The per-group lines: where each group reads the store from, and what that costs."""
    from ..store.objectstore import scheme_of

    if scheme_of(e.rendezvous) in ("file", "memory"):
        return [f"  group {g.group:<14} {g.replicas} × {g.backend}" for g in e.groups]
    lines = ["  by group (reads priced by where each group runs against the store):" if len(e.groups) > 1 else
             "  where it runs (reads priced against the store's region):"]
    for g in e.groups:
        name = g.group if len(e.groups) > 1 else "replicas"
        line = f"    {name:<12} {g.replicas} × {g.backend:<10} {g.place.replace('_', '-')} ({g.why})"
        if g.transfer_cost is not None:
            line += f"; down {_size(g.bytes_down)}, ${g.transfer_cost:,.2f} + requests ${g.requests_cost:,.2f}"
        lines.append(line)
    if e.groups[0].transfer_cost is not None and len(e.groups) > 1:
        total = sum(g.transfer_cost + g.requests_cost for g in e.groups)
        lines.append(f"    the run, priced by group: ${total:,.2f}")
    return lines


def format_estimate(e: Estimate) -> str:
    """The estimate as `diloco dryrun` and the first lines of `diloco run` print it."""
    lanes = f"{e.fewest_lanes}–{e.lanes}" if e.fewest_lanes != e.lanes else str(e.lanes)
    nodes = "–".join(str(k) for k in (e.nodes[0], e.nodes[-1]) if k) if len(e.nodes) > 1 else str(e.nodes[0])
    island = f" on {nodes} nodes" if e.nodes[-1] > 1 else ""
    head = (f"estimate: {e.replicas} replicas × {lanes} process{'es' if e.lanes > 1 else ''}{island}, {e.transport}, "
            f"H={e.sync_every}" + (f", {e.fragments} fragments" if e.fragments > 1 else ""))
    if not e.parameters:
        return (f"{head}\n  model size unknown: set [diloco] parameters = N for an estimate now; otherwise the "
                f"replicas measure it at round 1 and `diloco status RUN` shows the estimate\n")
    head += f", {e.parameters:,} parameters ({e.parameters_from})"
    r = e.round
    lines = [head,
             f"  per replica per round  up {_size(r.bytes_up)}, down {_size(r.bytes_down)}; {r.request_count:,.0f} requests "
             f"({r.puts:,.0f} PUT, {r.gets:,.0f} GET, {r.lists:,.0f} LIST)",
             f"  per round (all)        {r.request_count * e.replicas:,.0f} requests, {_size(r.bytes_down * e.replicas)} read"]
    for k in (k for k in e.nodes if k > 1):
        t = e.per_node(k)
        lines.insert(2, f"  per node per round     up {_size(t.bytes_up)}, down {_size(t.bytes_down)} with {k} nodes a "
                        f"replica (each node's lanes move 1/{k} of it, on its own link)")
    if e.run is None:
        lines.append("  whole run              set [diloco] total_steps for the run's totals and cost")
    else:
        t, c = e.run, e.cost
        lines.append(f"  whole run ({e.rounds} rounds) up {_size(t.bytes_up)}, down {_size(t.bytes_down)}; "
                     f"{t.request_count:,.0f} requests (checkpoints and metrics included)")
        places = ", ".join(f"${v:,.2f} {k.removeprefix('transfer_').replace('_', '-')}" for k, v in c.items()
                           if k.startswith("transfer_"))
        from ..store.objectstore import scheme_of

        local = scheme_of(e.rendezvous) in ("file", "memory")
        lines.append(f"  at list prices         requests ${c['requests']:,.2f}; reading the store: {places}")
        if local:
            lines.append("                         (this run's store is local: nothing is billed; that is the same "
                         f"run on {e.prices.get('cloud', 'aws')})")
    if e.groups:
        lines += format_groups(e)
    per_hour = 3600 / e.poll_max * e.prices.get("requests", {}).get("list", 0) / 1000
    lines.append(f"  waiting costs polls    at most {3600 / e.poll_max:,.0f} LIST per replica-hour spent waiting "
                 f"(${per_hour:,.3f})")
    lines.append(f"  prices                 {e.prices.get('cloud', '?')}, {e.prices.get('as_of', '?')}: "
                 f"{e.prices.get('source', '?')}")
    return "\n".join(lines) + "\n"


def estimate_view(record: Any, rounds: list[Any]) -> dict[str, Any]:
    """A recorded run's (`diloco.runrecord.state.RunRecord`) estimate, with the measured model size if the
    spec gave none, and the traffic its replicas counted over the same `rounds`: `diloco status`
    (`diloco.api.Run.view`) shows both so the estimate can be checked against the run."""
    counted = {"rounds": len(rounds), "bytes_up": 0, "bytes_down": 0}
    for s in rounds:
        for row in s.rows:
            counted["bytes_up"] += row.bytes_up
            counted["bytes_down"] += row.bytes_down
            for k, v in row.requests.items():
                counted[k] = counted.get(k, 0) + v
    try:
        spec = record.spec
        measured = next((s.parameters for s in reversed(rounds) if s.parameters), None)
        if spec.diloco.get("parameters") or not measured:
            est = estimate(spec, rendezvous=record.rendezvous)
        else:
            est = estimate(spec, parameters=measured, parameters_from="measured at round 1", rendezvous=record.rendezvous)
    except (KeyError, TypeError, UserError):
        return {"estimate": None, "counted": counted}
    out = est.to_dict()
    if est.round is not None and rounds:
        n = len(rounds)
        same = est.first_round.plus(est.round.times(n - 1)).times(est.replicas)
        out["for_counted_rounds"] = {"bytes_up": same.bytes_up, "bytes_down": same.bytes_down, "puts": same.puts,
                                     "gets": same.gets, "lists": same.lists, "requests": same.request_count}
    return {"estimate": out, "counted": counted}
