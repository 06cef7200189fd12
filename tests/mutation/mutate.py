"""`make mutate`: mutation testing (mutmut) of the modules whose rules users rely on, one group of
modules at a time (tests/mutation/groups.toml), each within a time budget, then a score per module.

Each group runs in its own folder, build/mutate/GROUP, laid out so that mutmut's names are the
modules' import names: `tbpipe/<top folder>` links to the repository's folders, and mutmut copies the
group's sources into `mutants/tbpipe/...`. mutmut runs pytest from `mutants/` with the plugin
tests/mutation/redirect.py, which imports the copied (mutated) modules ahead of the editable install.

The score of a module is (killed + timed out + crashed) / (all - equivalent - not run). Mutants
listed in tests/mutation/equivalent.toml are left out; mutants the budget left unrun are counted
apart. Survivors and their diffs go to build/mutate/GROUP/survivors.txt.

    python tests/mutation/mutate.py [--budget MINUTES] [--keep] [GROUP ...]
    python tests/mutation/mutate.py --groups-file tests/mutation/before.toml --sample 20 --seed 55 GROUP

A group with `tests_at` (a git revision) runs its test files as they were at that revision (the other
files of tests/ as they are now). `--sample N --seed S` runs N of each module's selected mutants
(equivalent ones left out) drawn at random with seed S, and scores those only; with `--keep`, those of
them an earlier run judged are not run again.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import random
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
WORK = ROOT / "build" / "mutate"
# The repository's folders that the wheel maps into the `tbpipe` namespace.
PACKAGE_FOLDERS = ("capture", "pipeline", "schemas", "sql")
PLUGIN = "tbpipe_mutation_redirect"

# mutmut's exit codes of a mutant's test run, as this score counts them (mutmut.stats names them).
KILLED, SURVIVED, NOT_RUN = "killed", "survived", "not run"
OUTCOME_BY_STATUS = {
    "killed": KILLED,
    "timeout": KILLED,  # the tests ran past their CPU time limit: the mutant changed something
    "segfault": KILLED,  # the test process crashed (or was killed past its limit)
    "survived": SURVIVED,
    "no tests": SURVIVED,  # no selected test reaches the mutated function
    "suspicious": SURVIVED,
    "not checked": NOT_RUN,  # the budget ran out first
    "check was interrupted by user": NOT_RUN,
    "skipped": NOT_RUN,
}


def load_groups(path: Path) -> dict[str, dict[str, list[str]]]:
    return tomllib.loads(path.read_text())


def load_equivalent() -> dict[str, str]:
    return tomllib.loads((HERE / "equivalent.toml").read_text())


def relink(link: Path, target: Path) -> None:
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(target)


def mutmut_section(group: dict[str, list[str]]) -> str:
    """The [tool.mutmut] table of a group's pyproject.toml (the repository's, pytest's settings kept)."""
    for source in group["sources"] + [test.partition("::")[0] for test in group["tests"]]:
        if not (ROOT / source).exists():
            raise SystemExit(f"tests/mutation/groups.toml: {source} does not exist")
    settings = {
        "source_paths": [f"tbpipe/{source}" for source in group["sources"]],
        "pytest_add_cli_args_test_selection": group["tests"],
        # Spark's tests are left out: a JVM per mutant is past any budget, and their rules have
        # DuckDB twins in the same files.
        "pytest_add_cli_args": ["-p", PLUGIN, "-p", "no:cacheprovider", "-m", "not spark"],
        "also_copy": [f"{PLUGIN}.py", "sitecustomize.py"],
        # A mutant's tests may run this many times their unmutated CPU time (plus a constant) first.
        "timeout_multiplier": 5.0,
        "timeout_constant": 5.0,
        "use_git_change_detection": False,
    }
    lines = ["", "[tool.mutmut]"] + [f"{key} = {json.dumps(value)}" for key, value in settings.items()]
    return "\n".join(lines) + "\n"


def prepare(name: str, group: dict[str, list[str]], keep: bool) -> Path:
    """The group's folder, with a fresh `mutants/` unless `keep`."""
    folder = WORK / name
    if not keep:
        shutil.rmtree(folder / "mutants", ignore_errors=True)
    (folder / "tbpipe").mkdir(parents=True, exist_ok=True)
    for top in PACKAGE_FOLDERS:
        relink(folder / "tbpipe" / top, ROOT / top)
    link_tests(folder / "tests", group)
    relink(folder / f"{PLUGIN}.py", HERE / "redirect.py")
    relink(folder / "sitecustomize.py", HERE / "sitecustomize.py")
    pyproject = (ROOT / "pyproject.toml").read_text()
    (folder / "pyproject.toml").write_text(pyproject + mutmut_section(group))
    return folder


def link_tests(tests: Path, group: dict) -> None:
    """The group's `tests`: a link to the repository's, or with `tests_at` a folder of links to them
    but for the group's test files, written as they were at that revision."""
    if tests.is_symlink() or tests.is_file():
        tests.unlink()
    elif tests.exists():
        shutil.rmtree(tests)
    revision = group.get("tests_at")
    if revision is None:
        tests.symlink_to(ROOT / "tests")
        return
    tests.mkdir()
    files = {test.partition("::")[0].removeprefix("tests/") for test in group["tests"]}
    for entry in (ROOT / "tests").iterdir():
        if entry.name not in files:
            (tests / entry.name).symlink_to(entry)
    for name in files:
        old = subprocess.run(["git", "show", f"{revision}:tests/{name}"], cwd=ROOT, capture_output=True, text=True)
        if old.returncode:
            raise SystemExit(f"tests/{name} at {revision}: {old.stderr.strip()}")
        (tests / name).write_text(old.stdout)


# mutmut's first step alone (copy the sources, write every mutant and its .meta file), run in the
# group's folder, so that a sample can be drawn from the mutants' names before `mutmut run`.
GENERATE = """
import os
from mutmut.__main__ import create_mutants
from mutmut.mutation.trampoline import set_mutant_under_test
from mutmut.utils.file_utils import copy_also_copy_files, copy_src_dir
set_mutant_under_test("mutant_generation")
os.makedirs("mutants", exist_ok=True)
copy_src_dir()
copy_also_copy_files()
create_mutants(2)
"""


def sample(folder: Path, patterns: list[str], equivalent: dict[str, str], size: int, seed: int) -> list[str]:
    """`size` of each module's selected, non-equivalent mutants, drawn with `seed` (all where fewer)."""
    subprocess.run([sys.executable, "-c", GENERATE], cwd=folder, check=True, stdout=subprocess.DEVNULL)
    names = []
    for mutants in selected(statuses(folder), patterns).values():
        pool = sorted(key for key, status in mutants.items() if status != "skipped" and key not in equivalent)
        names += sorted(random.Random(seed).sample(pool, min(size, len(pool))))
    return names


# How often a running mutmut's meta files are copied aside (see `run_group`).
META_COPY_INTERVAL_S = 5.0


def run_group(folder: Path, budget_s: int, children: int, rerun: list[str]) -> int:
    """mutmut run in `folder`, interrupted (it keeps what it finished) once `budget_s` has passed.

    mutmut rewrites a module's meta file in place after every mutant, so the interrupt can land
    between its truncation and its write and leave it empty: the files are copied aside every few
    seconds while it runs, and one left unreadable is put back from its copy (the mutants judged
    since then count as not run)."""
    mutmut = Path(sys.executable).parent / "mutmut"
    command = ["timeout", "--signal=INT", "--kill-after=60", str(budget_s), str(mutmut), "run"]
    command += ["--max-children", str(children)] + rerun
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    process = subprocess.Popen(command, cwd=folder, env=env)
    while True:
        try:
            code = process.wait(timeout=META_COPY_INTERVAL_S)
            break
        except subprocess.TimeoutExpired:
            copy_meta_files(folder)
    restore_meta_files(folder)
    return code


def _read_meta(meta: Path) -> dict | None:
    try:
        return json.loads(meta.read_text())
    except (OSError, ValueError):
        return None


def copy_meta_files(folder: Path) -> None:
    for meta in (folder / "mutants").rglob("*.py.meta"):
        if _read_meta(meta) is not None:
            shutil.copyfile(meta, meta.with_name(meta.name + ".last"))


def restore_meta_files(folder: Path) -> None:
    for meta in (folder / "mutants").rglob("*.py.meta"):
        last = meta.with_name(meta.name + ".last")
        if _read_meta(meta) is None and last.exists():
            print(f"{meta}: left unreadable by the interrupt, put back from its copy of a few seconds before")
            shutil.copyfile(last, meta)
        last.unlink(missing_ok=True)


def statuses(folder: Path) -> dict[str, dict[str, str]]:
    """{source path in the group's folder: {mutant name: mutmut's status}} from its meta files."""
    from mutmut.stats import status_by_exit_code

    by_path: dict[str, dict[str, str]] = {}
    for meta in sorted((folder / "mutants").rglob("*.py.meta")):
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        path = str(meta.relative_to(folder / "mutants").with_suffix(""))
        by_path[path] = {key: status_by_exit_code[code] for key, code in codes.items()}
    return by_path


def exit_codes(folder: Path) -> dict[Path, dict[str, int | None]]:
    return {meta: json.loads(meta.read_text())["exit_code_by_key"] for meta in (folder / "mutants").rglob("*.py.meta")}


def restore_kills(folder: Path, before: dict[Path, dict[str, int | None]]) -> None:
    """After a `--keep` run: mutmut forgets every result when the group's tests change (added test
    files), and reruns only the mutants named; those killed before stay killed (more tests kill more)."""
    from mutmut.stats import status_by_exit_code

    for meta, codes in before.items():
        if not meta.exists():
            continue
        data = json.loads(meta.read_text())
        now = data["exit_code_by_key"]
        for key, code in codes.items():
            if now.get(key, 0) is None and OUTCOME_BY_STATUS[status_by_exit_code[code]] == KILLED:
                now[key] = code
        meta.write_text(json.dumps(data, indent=4))


def names_with(by_path: dict[str, dict[str, str]], equivalent: dict[str, str], *outcomes: str) -> list[str]:
    return [
        key
        for mutants in by_path.values()
        for key, status in mutants.items()
        if OUTCOME_BY_STATUS[status] in outcomes and key not in equivalent
    ]


def selected(by_path: dict[str, dict[str, str]], patterns: list[str]) -> dict[str, dict[str, str]]:
    """The mutants of the group's `mutants` patterns (all when it has none); the others count as not run."""
    if not patterns:
        return by_path
    return {
        path: {
            key: status if any(fnmatch.fnmatch(key, pattern) for pattern in patterns) else "skipped"
            for key, status in mutants.items()
        }
        for path, mutants in by_path.items()
    }


def to_run(folder: Path, group: dict[str, list[str]], equivalent: dict[str, str], keep: bool) -> list[str] | None:
    """mutmut's arguments: the group's patterns, or with `keep` its survivors and unrun mutants; None:
    nothing is left to run."""
    patterns = group.get("mutants", [])
    if not keep:
        return patterns
    by_path = selected(statuses(folder), patterns)
    if not by_path:
        return patterns  # no earlier results
    names = names_with(by_path, equivalent, SURVIVED) + [
        key for mutants in by_path.values() for key, status in mutants.items() if status == "not checked"
    ]
    if not patterns and len(names) > 2000:
        return []  # mutmut runs the unrun ones by itself; survivors stand
    return names or None


def score_rows(by_path: dict[str, dict[str, str]], equivalent: dict[str, str]) -> list[str]:
    rows = []
    for path, mutants in by_path.items():
        outcomes = Counter(
            "equivalent" if key in equivalent else OUTCOME_BY_STATUS[status] for key, status in mutants.items()
        )
        judged = outcomes[KILLED] + outcomes[SURVIVED]
        score = f"{100 * outcomes[KILLED] / judged:.1f}%" if judged else "-"
        rows.append(
            f"| {path.removeprefix('tbpipe/')} | {len(mutants)} | {outcomes['equivalent']} | {outcomes[KILLED]}"
            f" | {outcomes[SURVIVED]} | {outcomes[NOT_RUN]} | {score} |"
        )
    return rows


# Prints each mutant's diff; run by mutmut's interpreter in the group's folder (mutmut reads its
# settings there). One process for all: `mutmut show` per mutant starts mutmut each time.
SHOW_DIFFS = """
import sys
from mutmut.mutation.diff_apply import get_diff_for_mutant
for line in sys.stdin:
    name, status, path = line.split()
    print(f"# {name}: {status}")
    print(get_diff_for_mutant(name, path=path))
"""


def write_survivors(folder: Path, by_path: dict[str, dict[str, str]], equivalent: dict[str, str]) -> None:
    names = set(names_with(by_path, equivalent, SURVIVED))
    listed = [f"{key} {status.replace(' ', '_')} {path}" for path, mutants in by_path.items()
              for key, status in mutants.items() if key in names]  # fmt: skip
    with open(folder / "survivors.txt", "w") as out:
        subprocess.run([sys.executable, "-c", SHOW_DIFFS], cwd=folder, input="\n".join(listed), stdout=out, text=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("groups", nargs="*", help="groups of tests/mutation/groups.toml (all by default)")
    parser.add_argument(
        "--groups-file", type=Path, default=HERE / "groups.toml", help="the groups (default tests/mutation/groups.toml)"
    )
    parser.add_argument("--sample", type=int, help="run this many of each module's selected mutants")
    parser.add_argument("--seed", type=int, default=0, help="the sample's random seed (default 0)")
    parser.add_argument("--budget", type=float, default=10.0, help="minutes per group (default 10)")
    parser.add_argument("--children", type=int, default=os.cpu_count() or 2, help="mutants run at once")
    parser.add_argument(
        "--keep", action="store_true", help="keep earlier results and rerun only survivors and unrun mutants"
    )
    args = parser.parse_args()
    groups = load_groups(args.groups_file)
    unknown = set(args.groups) - set(groups)
    if unknown:
        raise SystemExit(f"unknown groups {sorted(unknown)}; {args.groups_file} has {sorted(groups)}")
    equivalent = load_equivalent()
    failed, rows, known, ran_modules = [], [], set(), set()
    for name in args.groups or list(groups):
        folder = prepare(name, groups[name], args.keep)
        names = to_run(folder, groups[name], equivalent, args.keep)
        scored = groups[name].get("mutants", [])
        if args.sample is not None:
            scored = sample(folder, scored, equivalent, args.sample, args.seed)
            print(f"== {name}: sample of {args.sample} per module, seed {args.seed}:", *scored, sep="\n   ", flush=True)
            # With `keep`, the sampled mutants judged by an earlier run (of a smaller sample) are not run again.
            judged = set(names_with(statuses(folder), {}, KILLED, SURVIVED)) if args.keep else set()
            names = [key for key in scored if key not in judged] or None
        before = exit_codes(folder) if args.keep else {}
        print(f"== {name}: mutmut run in {folder} (budget {args.budget:g} min)", flush=True)
        if names is not None and run_group(folder, int(args.budget * 60), args.children, names) not in (0, 124, 130):
            failed.append(name)
        restore_kills(folder, before)
        by_path = selected(statuses(folder), scored)
        ran_modules.update(path.removesuffix(".py").replace("/", ".") for path in by_path)
        known.update(key for mutants in by_path.values() for key in mutants)
        rows += score_rows(by_path, equivalent)
        write_survivors(folder, by_path, equivalent)
    print("\n| module | mutants | equivalent | killed | survived | not run | score |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    stale = [key for key in equivalent if key not in known and key.rsplit(".", 1)[0] in ran_modules]
    for key in stale:
        print(f"equivalent.toml names {key}, which no longer exists")
    if failed:
        print(f"mutmut failed in groups {failed}: see their output above")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
