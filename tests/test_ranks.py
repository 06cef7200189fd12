"""Jobs of many ranks: rank labels read from the launchers' environment (capture/ranks.py), job
selectors, and `tbpipe ranks` (the sites where a job's ranks disagree).

The launches are real: `torchrun` (elastic, gloo on the CPU), `torch.multiprocessing.spawn` and
processes started by hand with the variables SLURM's `srun` sets, all under `tbpipe run --source
torch-ops`, captured once per module, concurrently (each is seconds of torch's import), and
ingested into one database. PyTorch is only installable for some Python versions on these machines;
elsewhere the launch tests skip with that reason and the environment's rules are still tested.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TBPIPE, manifest, run_python
from support.serve import free_port, line_of

from tbpipe.capture import ranks
from tbpipe.pipeline.db.selectors import RunSelectionError, parse_selector

# ------------------------------------------------------------------------------------------ the environment's rules


def test_each_launcher_gives_its_ranks_labels() -> None:
    torchrun = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "GROUP_RANK": "1", "TORCHELASTIC_RUN_ID": "r7"}
    assert ranks.labels_from_environment(torchrun) == {
        "rank": "3", "local_rank": "1", "world_size": "4", "node": "1", "job": "r7"
    }  # fmt: skip
    slurm = {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8", "SLURM_NODEID": "2", "SLURM_JOB_ID": "9"}
    assert ranks.labels_from_environment({**slurm, "SLURM_STEP_ID": "0"}) == {
        "rank": "5", "local_rank": "1", "world_size": "8", "node": "2", "job": "9.0"
    }  # fmt: skip
    ompi = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4",
            "OMPI_COMM_WORLD_NODE_RANK": "1", "PMIX_NAMESPACE": "prterun-a-1@1"}  # fmt: skip
    assert ranks.labels_from_environment(ompi) == {
        "rank": "2", "local_rank": "0", "world_size": "4", "node": "1", "job": "prterun-a-1@1"
    }  # fmt: skip
    # MPICH's Hydra: no node and no job id; the processes' parent run stands for the launch.
    assert ranks.labels_from_environment({"PMI_RANK": "1", "PMI_SIZE": "2"}, parent_run_id="p1") == {
        "rank": "1", "world_size": "2", "job": "p1"
    }  # fmt: skip


def test_the_innermost_launcher_wins_and_a_captured_launcher_names_the_job() -> None:
    # torchrun under srun: the ranks are torchrun's; torchrun's default rendezvous id names no job.
    both = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "9", "RANK": "6", "WORLD_SIZE": "8",
            "TORCHELASTIC_RUN_ID": "none"}  # fmt: skip
    assert ranks.labels_from_environment(both) == {"rank": "6", "world_size": "8", "job": "9"}
    assert ranks.labels_from_environment({**both, ranks.ENV_JOB: "launch-1"})["job"] == "launch-1"


def test_no_launcher_no_labels() -> None:
    assert ranks.labels_from_environment({"PATH": "/bin", "RANK": "", "SLURM_JOB_ID": "9"}) == {}


def test_torchrun_is_recognised_by_its_command_line() -> None:
    assert ranks.is_torchrun_launcher(["/venv/bin/torchrun", "--nproc-per-node", "2", "t.py"], [])
    assert ranks.is_torchrun_launcher(["-m"], ["python", "-m", "torch.distributed.run", "t.py"])
    assert not ranks.is_torchrun_launcher(["train.py"], ["python", "train.py", "torchrun"])


def test_selectors_name_jobs() -> None:
    assert parse_selector("job=abc").job == "abc" and parse_selector("job=abc").is_job
    latest = parse_selector("latest-job:suite=bert")
    assert latest.latest_job and latest.labels == {"suite": "bert"} and not latest.is_latest
    assert parse_selector("latest").is_latest and not parse_selector("latest").is_job
    with pytest.raises(RunSelectionError, match="job=ID"):
        parse_selector("job=")


SESSION = """
import json, sys
from tbpipe import capture
with capture.session(sys.argv[1], labels=json.loads(sys.argv[2])):
    pass
"""


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ({}, {"rank": "1", "local_rank": "1", "world_size": "2", "node": "0", "job": "4242.3"}),
        ({"job": "nightly", "suite": "s"}, {"rank": "1", "local_rank": "1", "world_size": "2", "node": "0",
                                            "job": "nightly", "suite": "s"}),
    ],
)  # fmt: skip
def test_a_session_takes_slurms_labels_and_the_given_ones_win(tmp_path: Path, given, expected) -> None:
    env = {"SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NTASKS": "2", "SLURM_NODEID": "0",
           "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "3"}  # fmt: skip
    code = SESSION.replace("sys.argv[1]", repr(str(tmp_path / "runs"))).replace("sys.argv[2]", repr(json.dumps(given)))
    result = run_python(code, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert manifest(run_dir)["labels"] == expected


def test_a_run_without_a_launcher_has_no_rank_labels(tmp_path: Path) -> None:
    env = {k: "" for k in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", ranks.ENV_JOB)}
    code = SESSION.replace("sys.argv[1]", repr(str(tmp_path / "runs"))).replace("sys.argv[2]", "'{}'")
    result = run_python(code, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert manifest(run_dir)["labels"] == {}


# ------------------------------------------------------------------------------------------ real launches

# Every rank runs a few DDP steps (the same collectives); rank 1 also runs an op of its own, at a
# line of its own, on every step. Under SLURM's variables the script passes the rank itself.
WORKLOAD = """import os

import torch
import torch.distributed as dist


def main():
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", rank=int(os.environ["SLURM_PROCID"]), world_size=int(os.environ["SLURM_NTASKS"]))
    rank = dist.get_rank()
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    for step in range(3):
        model(torch.ones(2, 4)).sum().backward()
        if rank == 1:
            torch.full((3,), 2.0).mul(2)  # only rank 1
    dist.destroy_process_group()


main()
"""

SPAWNED = """import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def work(index, world, url):
    dist.init_process_group("gloo", init_method=url, rank=index, world_size=world)
    t = torch.ones(2)
    for step in range(2):
        dist.all_reduce(t)  # the same on every rank
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(work, args=(2, sys.argv[1]), nprocs=2)
"""

# Variables a launcher or the machine may have set around the suite: none of them reach the launches.
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RUN_ID", "MASTER_ADDR",
                      "MASTER_PORT", ranks.ENV_JOB, ranks.ENV_NPROCS)  # fmt: skip


def _clean_env() -> dict[str, str]:
    return {
        k: v
        for k, v in os.environ.items()
        if k not in LAUNCHER_VARIABLES and not k.startswith(("SLURM_", "OMPI_", "PMI_", "PMIX_", "PET_"))
    }


class Launches:
    """The module's captured launches, ingested: the workload under torchrun and under SLURM-like
    variables (3 ranks each), and a spawn of 2."""

    def __init__(self, root: Path, symbol_cache: Path):
        self.root = root
        env = _clean_env()
        (root / "work.py").write_text(WORKLOAD)
        (root / "spawned.py").write_text(SPAWNED)
        run = [*TBPIPE, "run", "--source", "torch-ops", "--out"]
        torchrun = str(Path(sys.executable).with_name("torchrun"))
        commands = {"torchrun": [*run, str(root / "torchrun"), "--", torchrun, "--standalone", "--nproc-per-node",
                                 "3", "work.py"]}  # fmt: skip
        commands["spawn"] = [*run, str(root / "spawn"), "--", sys.executable, "spawned.py",
                             f"tcp://127.0.0.1:{free_port()}"]  # fmt: skip
        slurm = dict(env, SLURM_NTASKS="3", SLURM_NODEID="0", SLURM_JOB_ID="4242", SLURM_STEP_ID="0",
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))  # fmt: skip
        envs = {name: env for name in commands}
        for rank in range(3):
            name = f"slurm-{rank}"
            commands[name] = [*run, str(root / "slurm"), "--", sys.executable, "work.py"]
            envs[name] = dict(slurm, SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank))
        processes = {
            name: subprocess.Popen(command, cwd=root, env=envs[name], stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True)
            for name, command in commands.items()
        }  # fmt: skip
        for name, process in processes.items():
            output, _ = process.communicate(timeout=300)
            assert process.returncode == 0, f"{name}:\n{output}"
        from tbpipe.pipeline.db import IngestOptions, ingest_runs

        self.db = root / "tbpipe.duckdb"
        folders = [root / name for name in ("torchrun", "spawn", "slurm")]
        summary = ingest_runs(folders, IngestOptions(db_path=self.db, cache_dir=symbol_cache, progress=False))
        assert summary.ok, summary
        self.manifests = {
            folder.name: sorted((manifest(d) for d in folder.iterdir() if d.is_dir()), key=lambda m: m["run_id"])
            for folder in folders
        }

    def job(self, folder: str) -> str:
        (job,) = {m["labels"]["job"] for m in self.manifests[folder]}
        return job

    def tbpipe(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*TBPIPE, *args], capture_output=True, text=True, timeout=120, cwd=self.root)


@pytest.fixture(scope="module")
def launches(tmp_path_factory, symbol_cache) -> Launches:
    pytest.importorskip(
        "torch", reason=f"PyTorch is not installed for this Python ({sys.version.split()[0]}); the launches need it"
    )
    return Launches(tmp_path_factory.mktemp("ranks"), symbol_cache)


def _by_role(manifests: list[dict]) -> tuple[list[dict], list[dict]]:
    launchers = [m for m in manifests if m["labels"].get("role") == "launcher"]
    ranked = sorted((m for m in manifests if "rank" in m["labels"]), key=lambda m: int(m["labels"]["rank"]))
    return launchers, ranked


def test_torchrun_runs_carry_their_ranks_and_the_launcher_is_marked(launches: Launches) -> None:
    launchers, ranked = _by_role(launches.manifests["torchrun"])
    (launcher,) = launchers
    job = launches.job("torchrun")
    assert launcher["labels"] == {"role": "launcher", "job": job} and launcher["argv"][0].endswith("torchrun")
    assert [m["labels"] for m in ranked] == [
        {"rank": str(r), "local_rank": str(r), "world_size": "3", "node": "0", "job": job} for r in range(3)
    ]
    assert {m["parent_run_id"] for m in ranked} == {launcher["run_id"]}


def test_spawned_ranks_take_their_labels_from_the_process_group(launches: Launches) -> None:
    launchers, ranked = _by_role(launches.manifests["spawn"])
    (launcher,) = launchers
    job = launches.job("spawn")
    assert launcher["labels"] == {"role": "launcher", "job": job}
    assert [m["labels"] for m in ranked] == [
        {"rank": str(r), "local_rank": str(r), "world_size": "2", "node": "0", "job": job} for r in range(2)
    ]
    # multiprocessing's resource tracker, started by the launch, runs no rank: the job's, nothing more.
    others = [m for m in launches.manifests["spawn"] if m not in launchers and m not in ranked]
    assert all(m["labels"] == {"job": job} for m in others)


def test_slurm_variables_set_by_hand_label_the_ranks(launches: Launches) -> None:
    launchers, ranked = _by_role(launches.manifests["slurm"])
    assert launchers == []
    assert [m["labels"] for m in ranked] == [
        {"rank": str(r), "local_rank": str(r), "world_size": "3", "node": "0", "job": "4242.0"} for r in range(3)
    ]


def test_ranks_names_the_one_site_and_rank_that_diverge(launches: Launches) -> None:
    extra = line_of(WORKLOAD, "only rank 1")
    for folder in ("torchrun", "slurm"):
        result = launches.tbpipe("ranks", "--db", "tbpipe.duckdb", "--job", f"job={launches.job(folder)}", "-f", "json")
        assert result.returncode == 0, result.stderr
        report = json.loads(result.stdout)
        assert report["format"] == 1 and report["job"] == launches.job(folder) and report["ranks"] == [0, 1, 2]
        divergent = report["divergent"]
        assert divergent, report
        # aten::full and the ops it calls, aten::mul: all at that line, all on rank 1 alone.
        assert {(d["site"]["function"], d["site"]["portable_file"], d["site"]["line"]) for d in divergent} == {
            ("main", "work.py", extra)
        }
        assert {d["name"] for d in divergent} >= {"aten::full", "aten::mul"}
        for entry in divergent:
            assert entry["outlier_ranks"] == [1]
            counts = entry["counts_by_rank"]
            assert counts["1"] >= 3 and counts["0"] == counts["2"] == 0, entry
            assert [f["function"] for f in entry["traceback"] if f["kind"] == "python"][:1] == ["main"]
    failing = launches.tbpipe("ranks", "--db", "tbpipe.duckdb", "--job", f"job={launches.job('torchrun')}",
                              "--fail-on-divergence", "-f", "md")  # fmt: skip
    assert failing.returncode == 1, failing.stderr
    assert failing.stdout.startswith("**tbpipe ranks**: job") and f"main (work.py:{extra})" in failing.stdout
    agreeing = launches.tbpipe("ranks", "--db", "tbpipe.duckdb", "--job", f"job={launches.job('spawn')}",
                               "--fail-on-divergence")  # fmt: skip
    assert agreeing.returncode == 0, agreeing.stdout + agreeing.stderr
    assert "2 ranks agree" in agreeing.stdout


# What an op on gloo's worker thread is recorded under, innermost first, before the frame of the
# program (torch's, here) it is sited at: tbpipe's observer, RecordFunction, gloo's profiling callback
# and the wrapper that carries the profiler's thread-local state to that thread.
GLOO_MACHINERY = ("tbpipe::", "at::RecordFunction::runStartCallbacks", "recordAsyncWorkProfilingInfo",
                  "wrapPropagateTLSState")  # fmt: skip


def test_ops_on_gloos_thread_are_sited_past_the_recording_machinery(launches: Launches) -> None:
    from tbpipe.pipeline.db import open_database
    from tbpipe.pipeline.db.connection import query_rows

    con = open_database(launches.db, read_only=True)
    try:
        rows = query_rows(
            con,
            """
            WITH gloo AS (
                SELECT DISTINCT n.name, c.stack_id FROM run_stack_counts c JOIN event_names n USING (name_id)
                WHERE n.name LIKE 'gloo:%'
            )
            SELECT g.name, t.function, ss.site_depth, list(f.function ORDER BY f.depth) FILTER (WHERE f.depth < ss.site_depth)
            FROM gloo g JOIN stack_sites ss USING (stack_id) JOIN sites t USING (site_id)
            JOIN stack_frames f ON f.stack_id = g.stack_id
            GROUP BY g.name, g.stack_id, t.function, ss.site_depth
            """,
        )
    finally:
        con.close()
    assert {name for name, *_ in rows} >= {"gloo:all_reduce", "gloo:broadcast"}
    for name, site, depth, skipped in rows:
        assert site.startswith("c10d::ProcessGroupGloo::AsyncWork::execute("), (name, site)
        assert depth >= 3 and len(skipped) == depth
        assert all(any(part in frame for part in GLOO_MACHINERY) for frame in skipped), skipped
        assert any("at::RecordFunction::runStartCallbacks" in frame for frame in skipped)


def test_a_job_compared_with_an_identical_job_flags_nothing(launches: Launches) -> None:
    # The same program under another launcher: its sites match, its counts too, summed and rank by rank.
    first, second = launches.job("torchrun"), launches.job("slurm")
    for extra in ([], ["--per-rank"]):
        result = launches.tbpipe("report", "--db", "tbpipe.duckdb", "--candidate", f"job={second}", "--baseline",
                                 f"job={first}", "--format", "json", "--fail-on-regression", "--no-suspects",
                                 *extra)  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
        report = json.loads(result.stdout)
        assert report["regressions"] == [] and len(report["candidate"]["run_ids"]) == 3
        assert {change: n for change, n in report["counts"].items() if n} == {"unchanged": len(report["sites"])}
        if extra:
            assert sorted(report["per_rank"]) == ["0", "1", "2"]
            assert all(
                r["regressions"] == [] and len(r["candidate"]["run_ids"]) == 1 for r in report["per_rank"].values()
            )


def test_exports_take_a_job_and_the_newest_job(launches: Launches) -> None:
    job = launches.job("torchrun")
    result = launches.tbpipe(
        "export", "--db", "tbpipe.duckdb", "--run", f"job={job}", "-f", "collapsed", "-o", "x.folded"
    )
    assert result.returncode == 0, result.stderr
    assert "of 4 runs" in result.stderr  # the launcher and its 3 ranks
    newest = max((m for ms in launches.manifests.values() for m in ms), key=lambda m: (m["started_at"], m["run_id"]))
    result = launches.tbpipe("ranks", "--db", "tbpipe.duckdb", "--job", "latest-job", "-f", "json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["job"] == newest["labels"]["job"]


def test_the_lake_gives_the_same_answer(launches: Launches) -> None:
    result = launches.tbpipe("lake", "export", "--db", "tbpipe.duckdb", "--lake", "lake")
    assert result.returncode == 0, result.stdout + result.stderr
    answers = []
    for source in (["--db", "tbpipe.duckdb"], ["--lake", "lake"]):
        result = launches.tbpipe("ranks", *source, "--job", f"job={launches.job('torchrun')}", "-f", "json")
        assert result.returncode == 0, result.stderr
        answers.append(json.loads(result.stdout))
    assert answers[0] == answers[1] and answers[0]["divergent"]


@pytest.mark.default_interpreter_only
def test_the_job_page_shows_ranks_by_sites_divergent_first(launches: Launches) -> None:
    import httpx
    from support.browser import ARTIFACTS, chromium_page
    from support.serve import Server

    job = launches.job("torchrun")
    with Server(launches.db) as server:
        listed = httpx.get(server.url + "/api/jobs", timeout=30).json()["jobs"]
        assert {j["job"]: j["ranks"] for j in listed} == {job: 3, launches.job("spawn"): 2, "4242.0": 3}
        answer = httpx.get(f"{server.url}/api/jobs/{job}/ranks", timeout=60).json()
        from_cli = launches.tbpipe("ranks", "--db", "tbpipe.duckdb", "--job", f"job={job}", "-f", "json")
        assert answer == json.loads(from_cli.stdout)
        sides = {"candidate": f"job={job}", "baseline": "job=4242.0"}
        compared = httpx.get(server.url + "/api/compare", params={**sides, "per_rank": "true"}, timeout=120).json()
        assert compared["ok"] and sorted(compared["per_rank"]) == ["0", "1", "2"]
        with chromium_page(1300, 1000) as page:
            page.goto(f"{server.url}/jobs/{job}")
            assert "outlier rank 1" in page.inner_text("#verdict")
            labels = page.locator("#heat-map text:not(.rank):not(.count)").evaluate_all(
                "texts => texts.map(t => t.firstChild.nodeValue)"
            )
            divergent = page.locator("#heat-map text.divergent").count()
            assert divergent == len(answer["divergent"]) and labels[:divergent] == [
                f"{d['name']}  main (work.py:{line_of(WORKLOAD, 'only rank 1')})" for d in answer["divergent"]
            ]
            # A cell per rank and site; the outliers framed: rank 1's cells of the divergent rows.
            assert page.locator("#heat-map rect").count() == 3 * len(labels)
            assert page.locator("#heat-map rect.outlier").count() == divergent
            page.screenshot(path=str(ARTIFACTS / "job-page.png"), full_page=True)
            page.goto(f"{server.url}/compare?candidate=job%3D{job}&baseline=job%3D4242.0")
            assert page.inner_text("#verdict").startswith(f"No regressions: job={job} against job=4242.0")
            page.goto(f"{server.url}/runs/{answer['runs'][0]['run_id']}")
            page.click(f"a[href='/jobs/{job}']")
            assert page.url.endswith(f"/jobs/{job}")
