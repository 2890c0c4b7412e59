"""``--env-file`` (dotenv lines), ``--env 'GLOB'`` and the largest variable a process can get,
in-process (nothing is started)."""

from __future__ import annotations

import json
import os

import pytest
from support.helpers import spec_of

from launcher import cli
from launcher.backends import slurm as S
from launcher.cli import common
from launcher.errors import ConfigError
from launcher.node import task
from launcher.spec import envfile


def parse(text: str, environ: dict | None = None) -> dict[str, str]:
    return dict(envfile.parse_env_text(text, "job.env", environ or {}))



# --- the dotenv lines -----------------------------------------------------------------------------


def test_plain_lines_comments_blank_lines_and_export() -> None:
    text = ("# a comment\n\n   \nA=1\nexport B=two words   # a comment\n  C = spaced \nD=\nE=a#b\n"
            "F=x #\nexport\tG=tab\nH=#not a value\n")
    assert parse(text) == {"A": "1", "B": "two words", "C": "spaced", "D": "", "E": "a#b", "F": "x", "G": "tab",
                           "H": ""}


def test_single_quotes_are_literal() -> None:
    assert parse("A='x # $y \\n \"q\"'  # comment\n") == {"A": 'x # $y \\n "q"'}


def test_double_quotes_take_the_usual_escapes_and_nothing_expands() -> None:
    assert parse('A="l1\\nl2\\t\\"q\\" \\\\ \\$HOME $HOME `id` \\z"\n') == {"A": 'l1\nl2\t"q" \\ $HOME $HOME `id` \\z'}


def test_a_quoted_value_may_span_lines() -> None:
    text = 'CERT="-----BEGIN X-----\r\nabc\r\n-----END X-----"\r\nNEXT=1\r\n'
    assert parse(text) == {"CERT": "-----BEGIN X-----\nabc\n-----END X-----", "NEXT": "1"}
    assert parse("A='one\ntwo'\n") == {"A": "one\ntwo"}


def test_crlf_a_byte_order_mark_and_a_later_line_wins() -> None:
    assert parse("\ufeffA=1\r\nA=2\r\n") == {"A": "2"}
    assert envfile.parse_env_text("A=1\nB=2\nA=3\n", "f", {}) == [("A", "1"), ("B", "2"), ("A", "3")]


def test_a_bare_name_copies_this_shells_value() -> None:
    assert parse("HF_TOKEN\nexport X  # why\n", {"HF_TOKEN": "hf_x", "X": "y"}) == {"HF_TOKEN": "hf_x", "X": "y"}
    with pytest.raises(ConfigError, match=r"^--env-file job.env:2: HF_TOKEN has no value and is not set in this "
                                          r"shell; write HF_TOKEN=VALUE or export HF_TOKEN before pslaunch$"):
        parse("A=1\nHF_TOKEN\n")


@pytest.mark.parametrize("text, message", [
    ("A=1\nnot a line\n", r"job.env:2: not a NAME=VALUE line; write NAME=VALUE \(a comment starts with #\)"),
    ("1A=x\n", r"job.env:1: '1A' is not a variable name; a name is letters, digits and _"),
    ("A-B=x\n", r"job.env:1: 'A-B' is not a variable name"),
    ("A=1\nB='open\nC=2\n", r"job.env:2: the ' that opens B's value is never closed; end the value with '"),
    ('A="x"y\n', r"""job.env:1: text after the closing " of A's value \('y'\); quote the whole value, or put a #"""),
    ("A=1\nexport B C\n", r"job.env:2: not a NAME=VALUE line"),
    ("=x\n", r"job.env:1: '' is not a variable name"),
])
def test_a_bad_line_names_the_file_the_line_and_the_fix(text, message) -> None:
    with pytest.raises(ConfigError, match="^--env-file " + message):
        parse(text)


def test_a_bad_line_never_shows_a_secret_value() -> None:
    with pytest.raises(ConfigError) as e:
        parse('API_TOKEN="hunter2"trailing-secret\n')
    assert "trailing-secret" not in str(e.value) and "hunter2" not in str(e.value)


def test_the_file_itself(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"^--env-file .*nope: cannot read it: No such file or directory; give a "
                                          r"file of NAME=VALUE lines$"):
        envfile.read_env_file(str(tmp_path / "nope"), {})
    with pytest.raises(ConfigError, match="is a directory; give a file of NAME=VALUE lines"):
        envfile.read_env_file(str(tmp_path), {})
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="is not a regular file"):  # and no hang waiting for a writer
        envfile.read_env_file(str(fifo), {})
    (tmp_path / "bin").write_bytes(b"A=1\nB=\0\n")
    with pytest.raises(ConfigError, match=r"bin:2: a NUL byte"):
        envfile.read_env_file(str(tmp_path / "bin"), {})
    (tmp_path / "latin").write_bytes(b"A=1\nB=caf\xe9\n")
    with pytest.raises(ConfigError, match=r"latin:2: not UTF-8 text .*save the file as UTF-8"):
        envfile.read_env_file(str(tmp_path / "latin"), {})


# --- globs --------------------------------------------------------------------------------------------


def test_which_items_are_globs() -> None:
    assert envfile.is_glob("WANDB_*") and envfile.is_glob("NCCL_?") and envfile.is_glob("[AB]_X")
    assert not envfile.is_glob("WANDB_API_KEY") and not envfile.is_glob("A=*") and not envfile.is_glob("A:b*")


def test_a_glob_takes_the_matching_valid_names_case_sensitively() -> None:
    environ = {"WANDB_B": "2", "WANDB_A": "1", "wandb_c": "3", "WANDB_$(id)": "x", "XWANDB_D": "4"}
    assert envfile.expand_glob("WANDB_*", environ) == [("WANDB_A", "1"), ("WANDB_B", "2")]


# --- on the command line and in the config file ---------------------------------------------------------


def test_env_file_then_env_the_later_wins(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("WANDB_PROJECT", "p")
    monkeypatch.setenv("WANDB_API_KEY", "k")
    f1, f2 = tmp_path / "a.env", tmp_path / "b.env"
    f1.write_text("A=file1\nB=file1\nC=file1\n")
    f2.write_text("B=file2\n")
    s = spec_of(["-n", "1", "--env-file", str(f1), "--env", "C=cli", "--env-file", str(f2), "--env", "WANDB_*",
                 "true"])
    assert dict(s.env) == {"A": "file1", "B": "file2", "C": "cli", "WANDB_API_KEY": "k", "WANDB_PROJECT": "p"}


def test_env_file_in_the_config_file(tmp_path, monkeypatch) -> None:
    (tmp_path / "job.env").write_text("A=1\n")
    (tmp_path / "more.env").write_text("B=2\n")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "one.yaml").write_text("num-workers: 1\nenv-file: job.env\ncommand: [echo]\n")
    assert dict(spec_of(["--config", "one.yaml"]).env) == {"A": "1"}
    (tmp_path / "two.yaml").write_text("num-workers: 1\nenv_file: [job.env, more.env]\nenv: {C: 3}\ncommand: [echo]\n")
    assert dict(spec_of(["--config", "two.yaml"]).env) == {"A": "1", "B": "2", "C": "3"}


def test_a_bad_env_file_is_one_line_and_exit_2(tmp_path, capsys) -> None:
    (tmp_path / "job.env").write_text("OK=1\nWANDB PROJECT=x\n")
    assert cli.main(["-n", "1", "--env-file", str(tmp_path / "job.env"), "true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"pslaunch: error: --env-file {tmp_path / 'job.env'}:2: "
                                               "'WANDB PROJECT' is not a variable name"), err


def test_a_glob_that_matches_nothing_is_a_warning(capsys, monkeypatch) -> None:
    monkeypatch.delenv("NOSUCH_A", raising=False)
    monkeypatch.setenv("PSLT_ONE", "1")
    assert cli.main(["-n", "1", "-s", "0", "--env", "NOSUCH_*", "--env", "PSLT_*", "--dry-run", "true"]) == 0
    out = capsys.readouterr()
    text = out.out + out.err
    assert "warning: --env NOSUCH_* matches no variable of this shell; nothing is forwarded for it" in text
    assert "PSLT_*" not in text and "PSLT_ONE" in text  # (the dry run lists what was forwarded)


def test_a_glob_value_is_redacted_in_the_dry_run(capsys, monkeypatch) -> None:
    monkeypatch.setenv("WANDB_API_KEY", "wandb-secret-value")
    assert cli.main(["-n", "1", "-s", "0", "--env", "WANDB_*", "--dry-run", "true"]) == 0
    out = capsys.readouterr().out
    assert "WANDB_API_KEY" in out and "wandb-secret-value" not in out


def test_a_variable_no_process_can_get_is_refused_before_anything_starts(tmp_path, capsys) -> None:
    big = tmp_path / "big.env"
    big.write_text("BLOB=" + "x" * (300 * 1024) + "\n")
    assert cli.main(["-n", "1", "--env-file", str(big), "true"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("pslaunch: error: BLOB is 300 KiB; Linux starts no process with a variable over 128 KiB "
                   "(execve: Argument list too long): put the value in a file and set BLOB to its path")
    assert cli.main(["-n", "1", "--env-worker", "W=" + "y" * (200 * 1024), "true"]) == 2
    assert "W is 200 KiB" in capsys.readouterr().err
    # just under the limit is fine (NAME=VALUE plus its NUL)
    common.check_variable_sizes([("A", "x" * (common.MAX_VARIABLE_BYTES - 3))])
    with pytest.raises(ConfigError):
        common.check_variable_sizes([("A", "x" * (common.MAX_VARIABLE_BYTES - 2))])


# --- a large environment through Slurm (srun's environment) --------------------------------------------


def test_a_large_task_document_is_split_over_variables_execve_takes() -> None:
    doc = {"version": task.TASK_FILE_VERSION, "roles": {"worker": {"env": {f"V{i:03d}": "v" * 1000
                                                                            for i in range(300)}}}}
    env = S.step_environment({"PATH": "/bin", "PSLAUNCH_TASK_7": "stale", "PSLAUNCH_TASKS": "kept"}, doc)
    chunks = {k: v for k, v in env.items() if k.startswith("PSLAUNCH_TASK") and k != "PSLAUNCH_TASKS"}
    assert len(chunks) == 4 and "PSLAUNCH_TASK_7" not in env and env["PSLAUNCH_TASKS"] == "kept"
    assert all(len(k) + 1 + len(v) + 1 <= common.MAX_VARIABLE_BYTES for k, v in chunks.items())
    # the wrapper joins them, and takes every part out of the command's environment
    environ = dict(env)
    assert task.take_task_env("PSLAUNCH_TASK", environ) == doc
    assert environ == {"PATH": "/bin", "PSLAUNCH_TASKS": "kept"}
    assert json.loads(S.step_environment({}, {"version": 2})["PSLAUNCH_TASK"]) == {"version": 2}


def test_doctor_checks_with_the_jobs_env_file_and_globs(tmp_path, monkeypatch, capsys) -> None:
    """``pslaunch doctor`` takes the job's command line: its --env-file and --env globs give the
    variables the hosts are checked with (DMLC_INTERFACE, PYTHONPATH)."""
    from launcher.cli import doctor

    seen = {}

    def fake_run_doctor(hosts, opts, **kw):
        seen.update(kw["env"])
        return 0, "checked"

    monkeypatch.setattr(doctor, "run_doctor", fake_run_doctor)
    monkeypatch.setenv("PSLT_GLOB_A", "a")
    (tmp_path / "job.env").write_text("DMLC_INTERFACE=10.1.0.0/16\n")
    assert cli.main(["doctor", "-H", "127.0.0.1", "--env-file", str(tmp_path / "job.env"), "--env", "PSLT_GLOB_*",
                     "true"]) == 0
    assert seen == {"DMLC_INTERFACE": "10.1.0.0/16", "PSLT_GLOB_A": "a"}
    (tmp_path / "job.env").write_text("A B=1\n")
    assert cli.main(["doctor", "-H", "127.0.0.1", "--env-file", str(tmp_path / "job.env"), "true"]) == 2
    assert "--env-file " + str(tmp_path / "job.env") + ":1: 'A B' is not a variable name" in capsys.readouterr().err
