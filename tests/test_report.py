"""benchmarks/report.py: the pages' blocks are what results/ gives, and a block follows its file."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPORT = os.path.join(ROOT, "benchmarks", "report.py")


def report(*args):
    return subprocess.run([sys.executable, REPORT, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def block(readme, name):
    """The lines between a block's markers."""
    m = re.search(rf"^<!-- report:{re.escape(name)} -->\n(.*?)^<!-- /report:{re.escape(name)} -->$", readme,
                  re.S | re.M)
    assert m, f"README has no block {name}"
    return m.group(1)


@pytest.fixture
def copy(tmp_path):
    """A copy of the pages and results/, and report.py's options that point at it."""
    for page in ("README.md", "benchmarks/README.md", "docs/cost_model.md"):
        os.makedirs((tmp_path / page).parent, exist_ok=True)
        shutil.copy(os.path.join(ROOT, page), tmp_path / page)
    shutil.copytree(os.path.join(ROOT, "results"), tmp_path / "results")
    return tmp_path, ["--root", str(tmp_path), "--results", str(tmp_path / "results")]


def test_readme_matches_results():
    done = report("--check")
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_json_figure_changes_its_block(copy):
    tmp, options = copy
    path = tmp / "results" / "sparse_embedding_2.json"
    run = json.loads(path.read_text())
    run["zen hook"]["median_ms"] = 123.456
    path.write_text(json.dumps(run))
    name = "bench_loopback_4,sparse_embedding_2,sparse_embedding_4"
    before = (tmp / "benchmarks" / "README.md").read_text()
    assert "123.5 ms" not in block(before, name)

    done = report("--check", *options)
    assert done.returncode == 1
    assert "+" in done.stdout and "123.5 ms with the hook" in done.stdout  # the diff shows the new figure
    assert (tmp / "benchmarks" / "README.md").read_text() == before  # --check writes nothing

    done = report(*options)
    assert done.returncode == 0, done.stderr
    after = (tmp / "benchmarks" / "README.md").read_text()
    assert "123.5 ms with the hook" in block(after, name)
    # only that block changed: the text outside it, and every other block, is as it was
    outside = re.compile(rf"<!-- report:{re.escape(name)} -->\n.*?<!-- /report:{re.escape(name)} -->", re.S)
    assert outside.sub("", after) == outside.sub("", before)
    assert report("--check", *options).returncode == 0


def test_a_printed_table_changes_its_block(copy):
    """results/memory.txt has no JSON: its printed table is what the block comes from."""
    tmp, options = copy
    path = tmp / "results" / "memory.txt"
    text = path.read_text()
    line = next(l for l in text.splitlines() if re.search(r"1\.00%\s+sparcml", l))
    path.write_text(text.replace(line, re.sub(r"\S+$", "0.55", line.replace("4.85", "2.83"))))
    assert "sparcml 4.85 vs" in block((tmp / "benchmarks" / "README.md").read_text(), "memory")

    assert report("--check", *options).returncode == 1
    assert report(*options).returncode == 0
    memory = " ".join(block((tmp / "benchmarks" / "README.md").read_text(), "memory").split())
    assert "sparcml 2.83 vs 5.15" in memory
    assert "between 0.55 (sparcml at 1%)" in memory


def test_a_sweep_row_changes_the_tables(copy):
    """The accuracy table comes from the sweep's rows, the medians over its rounds computed as sweep.py does."""
    tmp, options = copy
    path = tmp / "results" / "sweep_accuracy.json"
    rows = json.loads(path.read_text())
    for row in rows:  # dense predicted exactly in every round and cell: MAPE 0.0%
        if row["scheme"] == "dense":
            row["time_predicted"] = row["time_median"]
    path.write_text(json.dumps(rows))
    assert report(*options).returncode == 0
    table = block((tmp / "benchmarks" / "README.md").read_text(), "sweep_accuracy")
    dense = next(l for l in table.splitlines() if l.split()[:1] == ["dense"])
    assert dense.split()[1:] == ["0.0%", "0.0%", "0.0%", "+0.0%", "0.0%", "0.0%"]
    runs = block((tmp / "benchmarks" / "README.md").read_text(), "sweep_accuracy#runs")
    assert "- dense: 0.0, 0.0 and 0.0%." in runs


def test_a_target_sentence_follows_its_file(copy):
    """Whether a target is met is written from the file, as its figures are: zen predicted 50% high everywhere."""
    tmp, options = copy
    path = tmp / "results" / "sweep_accuracy.json"
    rows = json.loads(path.read_text())
    for row in rows:
        if row["scheme"] == "zen":
            row["time_predicted"] = 1.5 * row["time_median"]
    path.write_text(json.dumps(rows))
    before = block((tmp / "benchmarks" / "README.md").read_text(), "sweep_accuracy#targets")
    assert "is met" in before and "zen's (50.0%)" not in before
    assert report(*options).returncode == 0
    after = " ".join(block((tmp / "benchmarks" / "README.md").read_text(), "sweep_accuracy#targets").split())
    assert "is not met" in after and "zen's (50.0%)" in after
    misses = block((tmp / "benchmarks" / "README.md").read_text(), "sweep_accuracy#misses")
    assert misses.count("| zen |") == 18  # every cell of zen's is 50% off now


def test_markers_are_checked(copy):
    tmp, options = copy
    readme = (tmp / "benchmarks" / "README.md").read_text()
    (tmp / "benchmarks" / "README.md").write_text(readme.replace("<!-- /report:memory -->\n", ""))
    done = report("--check", *options)
    assert done.returncode != 0 and "memory" in done.stderr
    (tmp / "benchmarks" / "README.md").write_text(readme.replace("report:memory -->", "report:nosuchfile -->"))
    done = report("--check", *options)
    assert done.returncode != 0 and "nosuchfile" in done.stderr


def test_a_missing_file_is_named(copy):
    tmp, options = copy
    os.remove(tmp / "results" / "train_lm_4x1gbit.json")
    done = report("--check", *options)
    assert done.returncode != 0 and "train_lm_4x1gbit.json" in done.stderr


def test_the_planner_example_is_what_the_planner_prints_now():
    """The planner predicts without measuring: its example in README (results/planner_example.txt, written by
    `make results`) must be what today's cost model prints for the same command."""
    import contextlib
    import io
    import shlex

    from zen import planner

    with open(os.path.join(ROOT, "results", "planner_example.txt")) as f:
        command, *printed = f.read().split("\n")
    argv = shlex.split(command.removeprefix("$ python -m zen.planner"))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert planner.main(argv) == 0
    assert out.getvalue() == "\n".join(printed), "rerun `make results` (or its planner line)"


def _repository(tmp_path):
    """(repo, commit): a git repository of its own with zen/ and results/, and ``commit(message)``, which
    commits everything in it and returns the commit's hash."""
    repo = tmp_path / "repo"
    (repo / "zen").mkdir(parents=True)
    (repo / "results").mkdir()

    def git(*args):
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout

    def commit(message):
        git("add", "-A")
        git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", message)
        return git("rev-parse", "HEAD").strip()

    git("init", "-q")
    return repo, commit


def test_a_block_from_a_file_measured_on_earlier_code_says_so(tmp_path):
    """In a repository of its own: a results file committed with the code, then zen/ changed (committed or
    not): the block's mark names the file and its commit; with the code as measured, no mark."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import report as r

    repo, commit_all = _repository(tmp_path)
    (repo / "zen" / "x.py").write_text("a = 1\n")
    (repo / "results" / "run.json").write_text("{}")
    commit = commit_all("measured")
    root, r.ROOT = r.ROOT, str(repo)
    try:
        assert r.stale_mark({"run.json"}) == []
        (repo / "results" / "other.txt").write_text("not measured code")  # outside zen/ and csrc/: still fresh
        assert r.stale_mark({"run.json"}) == []
        (repo / "zen" / "x.py").write_text("a = 2\n")
        assert r.stale_mark({"run.json"}) == [
            "", f"*Measured on an earlier version of zen/ or csrc/: run.json ({commit[:8]}).*"]
        assert r.stale_mark({"never_committed.json"}) == []  # no record: nothing to compare
        # and the page: a block written from the file ends with the mark
        blocks, r.BLOCKS = r.BLOCKS, {"run": lambda res: [f"figures {res.json('run')}"]}
        try:
            page = r._render_page("page.md", "<!-- report:run -->\n<!-- /report:run -->",
                                  r.Results(str(repo / "results")), set())
        finally:
            r.BLOCKS = blocks
        assert page.split("\n") == ["<!-- report:run -->", "figures {}", "",
                                     f"*Measured on an earlier version of zen/ or csrc/: run.json ({commit[:8]}).*",
                                     "<!-- /report:run -->"]
    finally:
        r.ROOT = root


def test_a_file_that_records_its_commit_is_checked_against_it(tmp_path):
    """A results file that records the code it measured (benchmarks/allreduce.py's rows: commit, code_changed),
    committed later than that code: checked against the recorded commit, and stale where it ran with changes."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import report as r

    repo, commit = _repository(tmp_path)
    (repo / "zen" / "x.py").write_text("a = 1\n")
    measured = commit("the code measured")
    (repo / "zen" / "x.py").write_text("a = 2\n")
    (repo / "results" / "run.json").write_text(json.dumps([dict(scheme="zen", commit=measured, code_changed=False)]))
    (repo / "results" / "dirty.json").write_text(json.dumps([dict(scheme="zen", commit=measured, code_changed=True)]))
    commit("the code changed, then the results committed")
    root, r.ROOT = r.ROOT, str(repo)
    try:
        assert r.stale_mark({"run.json"}) == [
            "", f"*Measured on an earlier version of zen/ or csrc/: run.json ({measured[:8]}).*"]
        (repo / "zen" / "x.py").write_text("a = 1\n")  # the code as measured again
        assert r.stale_mark({"run.json"}) == []
        assert r.stale_mark({"dirty.json"}) == [
            "", f"*Measured on an earlier version of zen/ or csrc/: dirty.json ({measured[:8]} with changes).*"]
    finally:
        r.ROOT = root
