"""`lmforge serve` options: where the API key comes from, and what --help documents."""

import argparse
import subprocess
import sys

import pytest

from lmforge.cli.main import main
from lmforge.cli.serve import api_key
from lmforge.errors import ConfigError


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"api_key": None, "api_key_file": None, **kw})


def test_key_from_env_file_or_flag(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("LMFORGE_API_KEY", raising=False)
    assert api_key(_args()) is None
    monkeypatch.setenv("LMFORGE_API_KEY", "from-env")
    assert api_key(_args()) == "from-env"
    path = tmp_path / "key"
    path.write_text("from-file\n")
    assert api_key(_args(api_key_file=str(path))) == "from-file"  # the file wins over the env
    assert capsys.readouterr().err == ""
    assert api_key(_args(api_key="from-flag")) == "from-flag"
    assert "visible to every local user in `ps`" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="give only one"):
        api_key(_args(api_key="a", api_key_file=str(path)))


@pytest.mark.parametrize("case", ["missing", "empty", "folder"])
def test_bad_key_file_is_one_line_and_exit_2(tmp_path, capsys, case):
    path = tmp_path / "key"
    if case == "empty":
        path.write_text("\n")
    elif case == "folder":
        path.mkdir()
    # the checkpoint does not exist either: the key file is checked before anything loads
    status = main(["serve", "--checkpoint", str(tmp_path / "none"), "--api-key-file", str(path),
                   "--device", "cpu"])  # fmt: skip
    err = capsys.readouterr().err
    assert status == 2
    assert err.count("\n") == 1 and err.startswith(f"error: --api-key-file {path}: ")
    assert ("empty" if case == "empty" else "cannot read it") in err


def test_help_documents_the_limits_and_the_key(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for words in ["--api-key-file PATH", "$LMFORGE_API_KEY", "visible to every local user",
                  "--max-body-bytes", "413", "--read-timeout", "408", "--max-queue", "429",
                  "Retry-After", "--keep-alive-timeout", "/docs, /redoc and /openapi.json",
                  "DNS-rebinding", "127.0.0.1 by default"]:  # fmt: skip
        assert words in text, words


def test_every_parser_builds_without_the_web_stack():
    """Registering `serve` must not import the server: a machine without starlette (a GPU
    image with only the training stack) still runs `lmforge dpo` and shows `serve --help`."""
    code = (
        "import sys\n"
        "for name in ('starlette', 'fastapi', 'uvicorn', 'prometheus_client'):\n"
        "    sys.modules[name] = None  # import raises ImportError\n"
        "from lmforge.cli.main import build_parser\n"
        "parser = build_parser()\n"
        "print(parser.parse_args(['dpo', '--help']))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "usage: lmforge dpo" in done.stdout
    assert not any(m in done.stderr for m in ("ModuleNotFoundError", "ImportError"))
    served = subprocess.run([sys.executable, "-c", code.replace("'dpo'", "'serve'")],
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert served.returncode == 0, served.stderr
    assert "--max-body-bytes" in served.stdout and "2097152" in served.stdout
