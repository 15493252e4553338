"""The ranking benchmark's protocol, read from benchmarks/ranking.yaml and checked: the federation's shape, the
datasets, seeds, grids and tables of rows, and what follows from them (each row's config, cost, rounds, the runs
still to do and each row's chosen lr)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from fractions import Fraction
from functools import cache, lru_cache
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import yaml
from calibrate import TASKS  # benchmarks/ is the script's own directory, so first on sys.path
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from zofed.fl.methods import get_method
from zofed.fl.plan import FederationPlan
from zofed.run.config import load_config
from zofed.run.federated import model_shares
from zofed.run.federated_config import FederatedConfig, federation_plan
from zofed.run.setup import build_model, prefix_cache

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
PROTOCOL = Path(__file__).resolve().with_name("ranking.yaml")
# Options the instruction benchmark (instruction_protocol.py) gives a method on every row; the ranking's own rows
# name theirs in ranking.yaml
METHOD_OPTIONS = {"fedkseed": ["federation.pool_size=64"], "fedavg": ["federation.log_uplinks=false"]}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Federation(_Strict):
    model: str
    clients: int = Field(gt=0)
    per_round: int = Field(gt=0)
    scheme: str
    alphas: list[float] = Field(min_length=1)
    test_fraction: float = Field(gt=0, lt=1)
    validation_examples: int = Field(gt=0)
    eval_examples: int = Field(gt=0)
    max_length: int = Field(gt=0)
    eval_batch_size: int = Field(gt=0)
    budget: float = Field(gt=0)
    evaluations: int = Field(gt=0)


class Calibration(_Strict):
    """How a table's budget is calibrated: its `calibrate` rows run once at max_multiple x the budget on `seeds`,
    scored on validation along the way; the table's budget is the smallest multiple of the federation's at which
    the best of them gains at least `gain` over the starting model on every dataset."""

    max_multiple: int = Field(ge=1)
    gain: float = Field(gt=0, lt=1)
    seeds: list[int] = Field(min_length=1)
    grid: list[float] | None = None  # the client lrs calibration tries (None: each row's own grid)


class Seeds(_Strict):
    tune: list[int] = Field(min_length=3)  # a grid point on one seed carries ~2.4 points of standard error
    final: list[int] = Field(min_length=1)


class Row(_Strict):
    kind: Literal["federated", "zero-shot"] = "federated"
    method: str | None = None
    grid: str | None = None
    trainable: Literal["table", "recipe", "own"] = "table"
    set: list[str] = []
    # another table whose row of this name this one shows: a row that trains its own set (`trainable: own`) runs
    # the same in every table of the same budget, so it runs once, there (the rest of the spec comes from it)
    from_table: str | None = None

    @model_validator(mode="after")
    def _complete(self) -> Row:
        if self.from_table is not None:
            if self.method or self.grid or self.set or self.kind != "federated":
                raise ValueError(f"a row shown from table {self.from_table!r} takes its spec from there: give it "
                                 "nothing but from_table")
            return self
        if self.kind == "zero-shot":
            if self.method or self.grid or self.set:
                raise ValueError("a zero-shot row trains nothing: it takes no method, grid or set")
            return self
        if self.method is None or self.grid is None:
            raise ValueError("a federated row needs a method and a grid")
        get_method(self.method)  # raises naming the registered methods
        for override in self.set:
            if override.split("=", 1)[0] in ("federation.method", "optimizer.lr", "federation.first_order_lr",
                                             "federation.rounds", "train.seed"):
                raise ValueError(f"{override!r}: the runner sets that key (method, lr, rounds, seed)")
        return self


class Table(_Strict):
    title: str
    trainable: list[str]
    pass_fraction: str  # the share of the blocks a perturbed pass runs with the prefix cached, e.g. "4/30"
    rows: dict[str, Row] = Field(min_length=1)
    budget: float | None = Field(None, gt=0)  # the table's own client compute (None: the federation's)
    calibrate: list[str] = []  # the ZO rows `--phase calibrate` runs to choose the budget
    # successive halving: the first tune seed runs every row's whole grid, the later ones only the `survivors`
    # points it scored best (None: every point on every tune seed)
    survivors: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _fraction(self) -> Table:
        try:
            value = Fraction(self.pass_fraction)
        except (ValueError, ZeroDivisionError):
            raise ValueError(f"pass_fraction {self.pass_fraction!r} is not a fraction such as 4/30") from None
        if not 0 <= value <= 1:
            raise ValueError(f"pass_fraction {self.pass_fraction} must lie in [0, 1]")
        return self

    @property
    def fraction(self) -> float:
        return float(Fraction(self.pass_fraction))


class Protocol(_Strict):
    federation: Federation
    datasets: list[str] = Field(min_length=1)
    seeds: Seeds
    grids: dict[str, list[float]]
    # the config key a grid's values go to where it is not the row's client lr (`lr_key`): a server lever
    grid_keys: dict[str, str] = {}
    tables: dict[str, Table] = Field(min_length=1)
    calibration: Calibration | None = None

    @model_validator(mode="after")
    def _names(self) -> Protocol:
        unknown = [d for d in self.datasets if d not in TASKS]
        if unknown:
            raise ValueError(f"datasets {unknown} have no template in benchmarks/calibrate.py TASKS ({list(TASKS)})")
        self._borrow()
        for table_name, table in self.tables.items():
            for name, row in table.rows.items():
                if row.grid is not None and row.grid not in self.grids:
                    raise ValueError(f"table {table_name}, row {name}: grid {row.grid!r} is not one of "
                                     f"{list(self.grids)}")
                kind = "first-order" if row.method and get_method(row.method).first_order else "zo"
                if row.grid is not None and row.grid not in self.grid_keys and (row.grid == "zo") != (kind == "zo"):
                    raise ValueError(f"table {table_name}, row {name}: a {kind} row on the {row.grid!r} grid")
            for name in table.calibrate:
                row = table.rows.get(name)
                if row is None or row.grid != "zo":
                    raise ValueError(f"table {table_name}: calibrate names {name!r}, which is not one of its ZO rows")
            if table.calibrate and self.calibration is None:
                raise ValueError(f"table {table_name} names calibrate rows but the protocol has no calibration")
        return self


    def _borrow(self) -> None:
        """Give each row shown from another table that table's spec, checking that it runs the same there."""
        for table_name, table in self.tables.items():
            for name, row in table.rows.items():
                if row.from_table is None:
                    continue
                home = self.tables.get(row.from_table)
                source = None if home is None else home.rows.get(name)
                if source is None or source.from_table is not None or source.trainable != "own":
                    raise ValueError(f"table {table_name}, row {name}: from_table {row.from_table!r} has no row "
                                     f"{name!r} of its own that trains its own set (trainable: own)")
                budgets = [t.budget or self.federation.budget for t in (table, home)]
                if budgets[0] != budgets[1]:
                    raise ValueError(f"table {table_name}, row {name}: its budget ({budgets[0]:g}) is not table "
                                     f"{row.from_table}'s ({budgets[1]:g}); run the row in this table instead")
                table.rows[name] = source.model_copy(update={"from_table": row.from_table})


def load_protocol(path: Path = PROTOCOL) -> Protocol:
    """The protocol in `path`, checked; a bad file raises SystemExit naming the file and each problem."""
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise SystemExit(f"{path}: cannot read the protocol: {err}") from None
    try:
        return Protocol.model_validate(data)
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
        raise SystemExit(f"{path}: not a valid ranking protocol: {problems}") from None


@lru_cache(maxsize=1)
def protocol() -> Protocol:
    return load_protocol()


def shape_overrides(p: Protocol) -> list[str]:
    """The federation's shape, shared by every row."""
    f = p.federation
    return [f"model.name={f.model}", f"federation.partition.num_clients={f.clients}",
            f"federation.clients_per_round={f.per_round}", f"federation.partition.scheme={f.scheme}",
            f"federation.partition.test_fraction={f.test_fraction}",
            f"data.validation_examples={f.validation_examples}", f"data.eval_examples={f.eval_examples}",
            f"task.max_length={f.max_length}", f"train.eval_batch_size={f.eval_batch_size}"]


def check_names(p: Protocol, table: str, rows: list[str] | None = None, datasets: list[str] | None = None) -> None:
    """SystemExit naming a table, row or dataset the protocol does not hold."""
    if table not in p.tables:
        raise SystemExit(f"table {table!r} is not in {PROTOCOL.name}: choose one of {list(p.tables)}")
    bad_rows = [r for r in rows or [] if r not in p.tables[table].rows]
    if bad_rows:
        raise SystemExit(f"rows {bad_rows} are not in table {table!r} of {PROTOCOL.name}: choose among "
                         f"{list(p.tables[table].rows)}")
    bad = [d for d in datasets or [] if d not in p.datasets]
    if bad:
        raise SystemExit(f"datasets {bad} are not in {PROTOCOL.name}: choose among {p.datasets}")


def row_overrides(p: Protocol, table: str, row: str, dataset: str | None = None) -> list[str]:
    """A row's config overrides without its lr, rounds, seed, evaluation split and output: the shape, the
    dataset's task, the table's trainable set (unless the recipe or the row names it) and the row's own set."""
    t, r = p.tables[table], p.tables[table].rows[row]
    trainable = t.trainable if r.trainable == "table" else []
    task = [*TASKS[dataset], f"data.source=shared:{dataset}"] if dataset is not None else []
    method = [f"federation.method={r.method}"] if r.method else []
    return [*shape_overrides(p), *task, *trainable, *r.set, *method]


def row_digest(p: Protocol, table: str, row: str, phase: str = "tune") -> str:
    """A short hash of what defines a row (its overrides without the dataset, and its budget): a stored row whose
    digest differs was run under another protocol. A calibration row keeps its digest when the table takes the
    budget it chose. What the simulator remembers is no part of it (an engine detail that changes no result)."""
    budget = p.federation.budget if phase == "calibrate" else table_budget(p, table)
    text = json.dumps([row_overrides(p, table, row), budget, p.tables[table].pass_fraction])
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def table_budget(p: Protocol, table: str) -> float:
    """The client compute every row of `table` spends (its own, once calibrated, else the federation's)."""
    return p.tables[table].budget or p.federation.budget


def phase_budget(p: Protocol, table: str, phase: str) -> float:
    """What a run of `phase` spends: a calibration run goes max_multiple times as far as the table's budget."""
    if phase == "calibrate":
        if p.calibration is None:
            raise SystemExit(f"{PROTOCOL.name} has no calibration section")
        return p.calibration.max_multiple * p.federation.budget
    return table_budget(p, table)


def phase_seeds(p: Protocol, phase: str) -> list[int]:
    return p.calibration.seeds if phase == "calibrate" and p.calibration else getattr(p.seeds, phase)


def lr_key(p: Protocol, table: str, row: str) -> str:
    """The config key a row's tuned value goes to: its grid's own key (a server lever), else its clients' lr."""
    r = p.tables[table].rows[row]
    if r.grid in p.grid_keys:
        return p.grid_keys[r.grid]
    return "federation.first_order_lr" if r.method and get_method(r.method).first_order else "optimizer.lr"


def base_config(p: Protocol, table: str, row: str, dataset: str | None = None) -> FederatedConfig:
    """A row's config before the runner's lr, rounds and seed: what the cost model and the report read."""
    return load_config(None, row_overrides(p, table, row, dataset), schema=FederatedConfig)


def pass_fraction(p: Protocol, table: str, config: FederatedConfig, splits: bool) -> float:
    """The share of the blocks a perturbed pass runs: the table's when the prefix is cached (zo.cache prefix, or
    auto where the model splits above its lowest block, `splits`), else all of them."""
    cached = config.zo.cache in ("prefix", "features") or (config.zo.cache == "auto" and splits)
    return p.tables[table].fraction if cached else 1.0


@cache
def _model_shares(model: str, task: str, trainable: str, classes: int) -> tuple[tuple[tuple[str, float], ...], bool]:
    """The cost rule's shares of a full pass for a task and trainable set (JSON of the config's sections) and a
    label count, measured from the model's weights as a run measures them (run/federated.py `model_shares`), and
    whether zo.cache auto caches a prefix there (run/setup.py `prefix_cache`)."""
    config = load_config(None, [f"model.name={model}"], schema=FederatedConfig)
    config = config.model_copy(update={"task": type(config.task).model_validate_json(task),
                                       "trainable": type(config.trainable).model_validate_json(trainable)})
    built, selected, head = build_model(config, classes, torch.device("cpu"), [f"label{i}" for i in range(classes)])
    auto = config.model_copy(update={"zo": config.zo.model_copy(update={"cache": "auto"})})
    splits = prefix_cache(auto, built, selected, head) is not None
    return tuple(model_shares(built, selected.names, head).items()), splits


@cache
def row_plan(table: str, row: str, dataset: str) -> FederationPlan:
    """A row's federation plan as its run builds it: the cost rule's shares, and whether zo.cache auto splits the
    model (so whether a round's prefixes are cached), measured on the model."""
    p = protocol()
    config = base_config(p, table, row, dataset)
    classes = len(config.task.verbalizer or [])
    shares, splits = _model_shares(config.model.name, config.task.model_dump_json(),
                                   config.trainable.model_dump_json(), classes)
    return federation_plan(config, p.federation.clients, pass_fraction(p, table, config, splits), **dict(shares))


@cache
def _costs(table: str, row: str, dataset: str) -> tuple[float, float]:
    """The most and the least a client's round of this row costs (equal unless its steps move some tensors)."""
    plan = row_plan(table, row, dataset)
    method = get_method(plan.method)
    local = method.round_plan(plan.round(0), plan.sampling)
    return method.forward_passes(local), method.least_passes(local, plan.tensor_shares)


def per_client_round_cost(table: str, row: str, dataset: str) -> float:
    """Forward-pass equivalents one client spends in a round of this row on `dataset` (the label head's share
    depends on its label count), as its method counts them (0 for a row that trains nothing): the most, for a
    method that charges each step the tensors it drew (`least_client_round_cost`)."""
    if protocol().tables[table].rows[row].kind == "zero-shot":
        return 0.0
    return _costs(table, row, dataset)[0]


def least_client_round_cost(table: str, row: str, dataset: str) -> float:
    """The least a client's round of this row can cost: below `per_client_round_cost` where the method charges
    each step from the tensors it drew (zofed's block sampling), so its rounds are known only as they run."""
    if protocol().tables[table].rows[row].kind == "zero-shot":
        return 0.0
    return _costs(table, row, dataset)[1]


def rounds_for(table: str, row: str, dataset: str, phase: str = "tune") -> int:
    """The rounds the phase's budget buys this row on `dataset` at most (0 for a row that trains nothing): all of
    them where every round costs the same, else the cap a run stops before (`budget_stop`)."""
    p = protocol()
    cost = least_client_round_cost(table, row, dataset)
    return 0 if cost == 0 else max(1, int(phase_budget(p, table, phase) // (p.federation.per_round * cost)))


def stop_at_budget(budget: float, round_most: float) -> Callable[[dict], bool]:
    """Ends a run after the round past which another, costing at most `round_most`, could spend more than `budget`
    (where every round costs the same: after the rounds budget // round cost)."""
    return lambda record: record["forward_passes"] + round_most > budget * (1 + 1e-12)


def check_charge(row: str, counted: float, least: float, most: float) -> None:
    """The row's cost model must be the run's: its client rounds cost between the least and the most its plan can."""
    if not least - 1e-9 <= counted <= most + 1e-9:
        raise RuntimeError(f"{row}: the run counted {counted} passes a client round, the benchmark planned {least} "
                           f"to {most}")


def budget_stop(table: str, row: str, dataset: str, phase: str) -> Callable[[dict], bool]:
    """Ends a run of the row where the phase's budget does (`stop_at_budget`, what `rounds_for` gives where every
    round costs the same)."""
    p = protocol()
    return stop_at_budget(phase_budget(p, table, phase), p.federation.per_round * per_client_round_cost(table, row,
                                                                                                        dataset))


def grid(p: Protocol, table: str, row: str, phase: str = "tune") -> list[float]:
    """The client lrs a row is tuned on (none for a row that trains nothing); calibration's own, when it names
    them."""
    r = p.tables[table].rows[row]
    if r.grid is None:
        return []
    if phase == "calibrate" and p.calibration is not None and p.calibration.grid is not None:
        return list(p.calibration.grid)
    return list(p.grids[r.grid])


PHASES = ("calibrate", "tune", "final")


def row_key(phase: str, table: str, row: str, dataset: str, alpha: float, seed: int, lr: float) -> str:
    return f"{phase}|{table}|{row}|{dataset}|{alpha}|{seed}|{lr:g}"


def setting_key(table: str, dataset: str, alpha: float, row: str) -> str:
    return f"{table}|{dataset}|{alpha}|{row}"


def is_current(p: Protocol, stored: dict) -> bool:
    """Whether a stored row belongs to the protocol as it is: its table, row, dataset and alpha exist, its seed
    and lr are the phase's, and what defines the row has not changed since it ran."""
    table = p.tables.get(stored.get("table", ""))
    if table is None or stored.get("row") not in table.rows or stored.get("dataset") not in p.datasets:
        return False
    if table.rows[stored["row"]].from_table is not None:  # the row runs in the table it is shown from
        return False
    if stored.get("alpha") not in p.federation.alphas or stored.get("phase") not in PHASES:
        return False
    if stored["phase"] == "calibrate" and stored["row"] not in table.calibrate:
        return False
    if stored["seed"] not in phase_seeds(p, stored["phase"]):
        return False
    lrs = grid(p, stored["table"], stored["row"], stored["phase"])
    if lrs and not any(abs(stored["lr"] - lr) <= 1e-12 * lr for lr in lrs):
        return False
    return stored.get("protocol") == row_digest(p, stored["table"], stored["row"], stored["phase"])


def current_rows(p: Protocol, table: dict) -> tuple[list[dict], int]:
    """The stored rows of the current protocol, with a copy under each table that shows a row from another
    (`from_table`), and how many stored rows belong to another protocol."""
    rows = list(table["rows"].values())
    kept = [r for r in rows if is_current(p, r)]
    shown = [{**r, "table": name, "from_table": r["table"]} for r in kept for name, t in p.tables.items()
             if r["row"] in t.rows and t.rows[r["row"]].from_table == r["table"]]
    return kept + shown, len(rows) - len(kept)


def choices(rows: list[dict]) -> dict[str, dict]:
    """Per (table, dataset, alpha, row): the lr with the best mean validation accuracy over the seeds it was tuned
    on; a point tuned on more seeds is never beaten by one tuned on fewer."""
    scores: dict[str, dict[float, list[float]]] = {}
    for r in rows:
        if r["phase"] == "tune":
            key = setting_key(r["table"], r["dataset"], r["alpha"], r["row"])
            scores.setdefault(key, {}).setdefault(r["lr"], []).append(r["final_accuracy"])
    chosen = {}
    for key, points in scores.items():
        lr, accs = max(points.items(), key=lambda kv: (len(kv[1]), float(np.mean(kv[1]))))
        chosen[key] = {"lr": lr, "validation_accuracy": float(np.mean(accs)), "seeds": len(accs),
                       "tried": sorted(points)}
    return chosen


def survivors(p: Protocol, table: str, row: str, dataset: str, stored: list[dict]) -> list[float] | None:
    """The grid points a table with `survivors` tunes on its later tune seeds: the best of the first tune seed's
    validation scores (ties to the smaller lr); None until that seed has run the whole grid."""
    lrs = grid(p, table, row)
    first = {r["lr"]: r["final_accuracy"] for r in stored
             if (r["phase"], r["table"], r["row"], r["dataset"], r["seed"]) == ("tune", table, row, dataset,
                                                                                  p.seeds.tune[0])}
    if any(lr not in first for lr in lrs):
        return None
    return sorted(sorted(lrs, key=lambda lr: (-first[lr], lr))[:p.tables[table].survivors])


def pending_runs(p: Protocol, table: str, phase: str, rows: list[str], datasets: list[str],
                 done: set[str], chosen: dict[str, dict], stored: list[dict] = ()) -> tuple[list[tuple], list[str]]:
    """The runs still to do, ordered by seed, then dataset, then row, then grid point (a partial sitting gives
    every row its first seed early; calibration runs each row's middle grid point first), and notes on rows left
    out (a final without tuning rows). A run is the tuple (phase, table, row, dataset, alpha, seed, lr); a
    zero-shot row runs once per dataset, in the finals.
    Under successive halving (the table's `survivors`) a later tune seed's runs are listed once the first seed's
    grid is in `stored` (the current rows): the runner asks again after each sitting."""
    notes, runs = [], []
    seeds = phase_seeds(p, phase)
    if phase == "calibrate":
        rows = [r for r in rows if r in p.tables[table].calibrate]
    for seed in seeds:
        for dataset in datasets:
            for alpha in p.federation.alphas if phase == "final" else p.federation.alphas[:1]:
                for row in rows:
                    spec = p.tables[table].rows[row]
                    if spec.from_table is not None:
                        if seed == seeds[0] and dataset == datasets[0]:
                            notes.append(f"{row} runs in table {spec.from_table}, which this table shows")
                        continue
                    if spec.kind == "zero-shot":
                        points = [0.0] if phase == "final" and seed == seeds[0] else []
                    elif phase == "tune" and p.tables[table].survivors and seed != seeds[0]:
                        points = survivors(p, table, row, dataset, list(stored))
                        if points is None and seed == seeds[1]:
                            notes.append(f"{row} on {dataset}: seeds {seeds[1:]} wait for seed {seeds[0]}'s whole "
                                         "grid (successive halving)")
                        points = points or []
                    elif phase in ("tune", "calibrate"):
                        points = grid(p, table, row, phase)
                    else:
                        c = chosen.get(setting_key(table, dataset, p.federation.alphas[0], row))
                        if c is None:
                            if seed == seeds[0]:
                                notes.append(f"no tuning rows for {row} on {dataset}: run --phase tune first; left "
                                             "out")
                            continue
                        points = [c["lr"]]
                    runs += [(phase, table, row, dataset, alpha, seed, lr) for lr in points
                             if row_key(phase, table, row, dataset, alpha, seed, lr) not in done]
    if phase == "calibrate":  # the grid's middle first, every row's, so the stop rule cuts the rest short early
        runs.sort(key=lambda run: (seeds.index(run[5]), datasets.index(run[3]), middle_first(
            grid(p, table, run[2], phase), run[6]), rows.index(run[2])))
    return runs, notes


def middle_first(lrs: list[float], lr: float) -> tuple[int, int]:
    """Where `lr` comes in its grid read from the middle out (the lower neighbour first): a calibration run that
    gains early stops every later one there (ranking_calibration.CalibrationStop), and the middle point is the
    likeliest to."""
    i = lrs.index(lr)
    return abs(i - (len(lrs) - 1) // 2), i


def multiple_rounds(p: Protocol, table: str, row: str, dataset: str) -> list[int]:
    """The rounds each multiple of the federation's budget (1 .. calibration.max_multiple) buys this row."""
    cost = per_client_round_cost(table, row, dataset)
    top = p.calibration.max_multiple if p.calibration else 1
    return [int(m * p.federation.budget // (p.federation.per_round * cost)) for m in range(1, top + 1)]


def curve_every(p: Protocol, phase: str, table: str, row: str, dataset: str) -> int:
    """The rounds between a run's curve points: `evaluations` a run, or for calibration two per budget's worth of
    rounds, so its curve reads off each multiple."""
    rounds = rounds_for(table, row, dataset, phase)
    if phase == "calibrate" and rounds:
        return max(1, multiple_rounds(p, table, row, dataset)[0] // 2)
    return max(1, rounds // p.federation.evaluations)


def run_overrides(p: Protocol, phase: str, table: str, row: str, dataset: str, alpha: float, seed: int,
                  lr: float, out: Path) -> list[str]:
    """Every override of one run: the row's, then what the runner sets (lr, rounds, cadence, split, seed). A
    calibration run evaluates twice per table budget's worth of rounds, so its curve reads off each multiple."""
    rounds = rounds_for(table, row, dataset, phase)
    every = curve_every(p, phase, table, row, dataset)
    runner = [f"data.evaluate_on={'test' if phase == 'final' else 'validation'}",
              f"federation.partition.alpha={alpha}", f"federation.partition.seed={seed}", f"train.seed={seed}",
              f"out_dir={out}"]
    if rounds:
        runner += [f"{lr_key(p, table, row)}={lr}", f"federation.rounds={rounds}",
                   f"federation.eval_every={every}"]
    return [*row_overrides(p, table, row, dataset), *runner]


# zofed's two components, and what makes each active in a resolved config
COMPONENTS = {"block_sampling": "personalized block sampling (each client draws the block a step perturbs from "
                                "its own distribution)",
              "server_momentum": "global adaptive server momentum"}


def zofed_settings(config: FederatedConfig, trainable_tensors: int, cached_examples: int) -> dict:
    """zofed's resolved settings in a config (`cached_examples`: its plan's, which depends on where the model
    splits), and which of its two components they leave active: block sampling needs more than one block to draw
    from (fl/personal.py draws each step's block from the client's pi), the adaptive server any optimizer other
    than plain averaging (sgd)."""
    fed, zo = config.federation, config.zo
    server = fed.server_optimizer.resolved(fed.method, fed.rounds)
    blocks = fed.sampling.blocks or trainable_tensors
    return {"estimator": zo.resolved_estimator(fed.method), "queries": zo.queries, "local_steps": fed.local_steps,
            "batch_size": config.train.batch_size, "cached_examples": cached_examples,
            "scalar_bits": fed.scalar_bits, "logit_adjust": fed.logit_adjust, "average_from": fed.average_from,
            "cache": zo.cache, "server_optimizer": server["name"], "server_lr": server["lr"],
            "personalize": fed.sampling.personalize, "blocks": blocks, "recipe": fed.recipe,
            "active": {"block_sampling": fed.sampling.personalize and blocks > 1,
                       "server_momentum": server["name"] != "sgd"}}
