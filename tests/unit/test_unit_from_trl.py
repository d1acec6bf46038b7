"""docs/from_trl.md against TRL's field names (tests/data/trl_1_16_fields.json) and our keys.

The page maps, per TRL config, every TRL-specific field to our keys in tables
`| TRL field | rlhf_dist key | note |` under a `## <Config>` heading, and the trainers'
call arguments in tables `| TRL argument | rlhf_dist key | note |`. Checked here, offline
and without TRL: (a) every stored TRL field has a row (a field a newer TRL adds, once the
JSON is regenerated with launch/trl_fields.py, fails with the list of unmapped names);
(b) every row names a stored field (a field TRL removed fails); (c) every key of ours the
tables name exists, with a valid value where one is given (a renamed key fails); and every
table is well formed (one header, a separator, the same number of cells per row). Also
launch/trl_fields.py itself, on a small fake TRL wheel.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlhf_dist.config import Config, config_from_dict, validate

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "from_trl.md"
FIELDS = ROOT / "tests" / "data" / "trl_1_16_fields.json"
SCRIPT = ROOT / "launch" / "trl_fields.py"

FIELD_HEADER = ["TRL field", "rlhf_dist key", "note"]
ARGUMENT_HEADER = ["TRL argument", "rlhf_dist key", "note"]
NOTES = ("no equivalent", "not needed", "planned")
STAGES = ("sft", "rm", "dpo", "kto")  # what `<stage>` stands for: the step-loop stages
TICKED = re.compile(r"`([^`]+)`")


@dataclasses.dataclass
class Table:
    section: str  # the first word of the `## ` heading above it
    line: int  # 1-based line of its header
    header: list[str]
    rows: list[tuple[int, list[str]]]  # (line, cells), short rows padded with ""
    widths: dict[int, int]  # line -> cells as written


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def tables(text: str) -> list[Table]:
    """Every Markdown table of `text`, with the heading it sits under."""
    found: list[Table] = []
    section, current = "", None
    for n, line in enumerate(text.splitlines(), 1):
        if line.startswith("## "):
            section = line[3:].split()[0].strip("`")
        if not line.startswith("|"):
            current = None
            continue
        if current is None:
            current = Table(section, n, cells(line), [], {})
            found.append(current)
        else:
            row = cells(line)  # a short row fails the well-formed test, not the others
            current.widths[n] = len(row)
            current.rows.append((n, row + [""] * (len(current.header) - len(row))))
    return found


@pytest.fixture(scope="module")
def doc_tables() -> list[Table]:
    return tables(DOC.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def stored() -> dict:
    return json.loads(FIELDS.read_text(encoding="utf-8"))


def config_keys() -> tuple[dict[str, dataclasses.Field], set[str]]:
    """({dotted leaf key: its dataclass field}, {dotted section}) of our Config."""
    keys: dict[str, dataclasses.Field] = {}
    sections: set[str] = set()

    def walk(obj, prefix: str) -> None:
        for f in dataclasses.fields(obj):
            value, path = getattr(obj, f.name), prefix + f.name
            if dataclasses.is_dataclass(value):
                sections.add(path)
                walk(value, path + ".")
            else:
                keys[path] = f

    walk(Config(), "")
    return keys, sections


KEYS, SECTIONS = config_keys()
TOP = {s.split(".")[0] for s in SECTIONS} | {"<stage>"}


def key_problem(text: str) -> str | None:
    """Why `text` (`key`, `key=value`, `section.*`, `<stage>.key`) is not ours, or None."""
    name, _, value = text.partition("=")
    names = [name.replace("<stage>", s) for s in STAGES] if "<stage>" in name else [name]
    for one in names:
        if one.endswith(".*"):
            if one[:-2] not in SECTIONS:
                return f"{one}: no such section"
            continue
        if one not in KEYS:
            return f"{one}: no such key"
        meta = KEYS[one].metadata
        if value and meta.get("choices") and value not in meta["choices"]:
            return f"{text}: {value!r} is not one of {meta['choices']}"
        if value and KEYS[one].type in (bool, "bool") and value not in ("true", "false"):
            return f"{text}: a bool key takes true or false"
    return None


def named_keys(cell: str) -> list[str]:
    """The keys a cell names: each backticked text, split at ` / `."""
    return [part.strip() for tick in TICKED.findall(cell) for part in tick.split(" / ")]


def test_every_table_is_well_formed(doc_tables):
    assert doc_tables, f"{DOC} holds no table"
    problems = []
    for t in doc_tables:
        if t.header not in (FIELD_HEADER, ARGUMENT_HEADER):
            problems.append(f"line {t.line}: header {t.header}")
        if not t.rows or set(t.rows[0][1]) - {"---"}:
            problems.append(f"line {t.line}: no '| --- |' separator under the header")
        if len(t.rows) < 2:
            problems.append(f"line {t.line}: a header without rows")
        for n, width in t.widths.items():
            if width != len(t.header):
                problems.append(f"line {n}: {width} cells, the header has {len(t.header)}")
    assert not problems, "\n".join(problems)


def field_rows(doc_tables, stored) -> dict[str, dict[str, int]]:
    """{config: {TRL field: line}} from the field tables; a field twice is an error."""
    out: dict[str, dict[str, int]] = {}
    for t in doc_tables:
        if t.header != FIELD_HEADER:
            continue
        assert t.section in stored, f"line {t.line}: field table under '## {t.section}'"
        seen = out.setdefault(t.section, {})
        for n, row in t.rows[1:]:
            names = TICKED.findall(row[0])
            assert names, f"line {n}: no `field` in the first cell"
            for name in names:
                assert name not in seen, f"line {n}: {name} already at line {seen[name]}"
                seen[name] = n
    return out


def test_every_trl_field_is_mapped(doc_tables, stored):
    """(a): a TRL field without a row (TRL added it) fails, listing all of them."""
    rows = field_rows(doc_tables, stored)
    missing = {
        config: sorted(set(names) - set(rows.get(config, {})))
        for config, names in stored.items()
        if config != "_header"
    }
    missing = {k: v for k, v in missing.items() if v}
    assert not missing, f"TRL fields without a row in {DOC.name}: {missing}"


def test_every_row_is_a_trl_field(doc_tables, stored):
    """(b): a row whose field the stored TRL does not have (TRL removed it) fails."""
    rows = field_rows(doc_tables, stored)
    unknown = {
        f"{config}.{name} (line {n})"
        for config, names in rows.items()
        for name, n in names.items()
        if name not in stored[config]
    }
    assert not unknown, f"rows naming no field of the stored TRL: {sorted(unknown)}"


def test_every_key_named_is_ours(doc_tables):
    """(c): our column names real keys (or says why there is none); keys in notes too."""
    problems = []
    for t in doc_tables:
        for n, row in t.rows[1:]:
            ours, note = row[1], row[2]
            keys = named_keys(ours)
            if not keys and not ours.startswith(NOTES):
                problems.append(f"line {n}: neither a key nor one of {NOTES}: {ours!r}")
            keys += [k for k in named_keys(note) if k.split(".")[0] in TOP and "." in k]
            problems += [f"line {n}: {p}" for k in keys if (p := key_problem(k))]
    assert not problems, "\n".join(problems)


def test_key_check_can_fail():
    """The checks above catch a renamed key, a bad value and a missing section."""
    assert key_problem("ppo.kl_coef") is None
    assert key_problem("<stage>.optim.lr") is None
    assert key_problem("ppo.critic_optim.*") is None
    assert key_problem("ppo.estimator=grpo") is None
    assert "no such key" in key_problem("ppo.kl_coefficient")
    assert "no such key" in key_problem("<stage>.optim.beta")
    assert "not one of" in key_problem("ppo.estimator=dpo")
    assert "no such section" in key_problem("ppo.actor.*")


def test_table_parsing_finds_broken_tables():
    """A short row and a header with no rows (the shape of an old bug of this page)."""
    short = "## GRPOConfig\n\n| TRL field | rlhf_dist key | note |\n| --- | --- | --- |\n| `beta` | x |\n"
    (table,) = tables(short)
    assert table.section == "GRPOConfig" and table.widths == {4: 3, 5: 2}
    headless = (
        "| TRL | ours | note |\n| --- | --- | --- |\nprose\n\n| a | b |\n| --- | --- |\n| 1 | 2 |\n"
    )
    first, second = tables(headless)
    assert len(first.rows) == 1 and len(second.rows) == 2


def test_the_grpo_example_is_a_valid_config():
    """The YAML example of the GRPO section loads and validates for 4 ranks."""
    text = DOC.read_text(encoding="utf-8")
    blocks = re.findall(r"```yaml\n(.*?)```", text, re.S)
    assert blocks, "no yaml example"
    for block in blocks:
        validate(config_from_dict(yaml.safe_load(block)), "ppo", world_size=4)


# launch/trl_fields.py on a fake wheel

TRAINING_ARGS = """
class TrainingArguments:
{fields}
    logging_steps: float = 500
"""


def fake_wheel(root: Path, version: str, configs: dict[str, str]) -> Path:
    """An unpacked 'wheel': trl/trainer/base_config.py, each config at its path, METADATA."""
    (root / f"trl-{version}.dist-info").mkdir(parents=True)
    (root / f"trl-{version}.dist-info" / "METADATA").write_text(f"Name: trl\nVersion: {version}\n")
    base = root / "trl" / "trainer" / "base_config.py"
    base.parent.mkdir(parents=True)
    base.write_text(
        "from transformers import TrainingArguments\n\n"
        "class _BaseConfig(TrainingArguments):\n"
        "    logging_steps: float = 10\n"
        "    base_only: int = 1\n"
    )
    for rel, body in configs.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body)
    return root


def run_script(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True
    )


def test_trl_fields_script_reads_a_wheel(tmp_path):
    spec = importlib.util.spec_from_file_location("trl_fields", SCRIPT)
    trl_fields = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trl_fields)  # its lists: the configs and the inherited names
    tf = tmp_path / "tf"
    tf.mkdir()
    (tf / "__init__.py").write_text('__version__ = "9.9.9"\n')
    fields = "\n".join(f"    {name}: int = 0" for name in trl_fields.INHERITED)
    (tf / "training_args.py").write_text(TRAINING_ARGS.format(fields=fields))
    simple = "from .base_config import _BaseConfig\n\nclass {0}(_BaseConfig):\n    learning_rate: float = 1e-6\n    {1}: int = 0\n"
    experimental = simple.replace(".base_config", "...trainer.base_config")
    new = {}
    for name, paths in trl_fields.CONFIGS.items():
        if name != "PPOConfig":  # trl/experimental/<x>/ imports the base from trl/trainer/
            text = simple if paths[0].startswith("trl/trainer/") else experimental
            new[paths[0]] = text.format(name, f"own_{name.lower()}")
    # a config that subclasses another config through an absolute import
    new["trl/trainer/dpo_config.py"] = (
        "from trl.trainer.sft_config import SFTConfig as Base\n\n"
        "class DPOConfig(Base):\n    beta: float = 0.1\n"
    )
    newest = fake_wheel(tmp_path / "new", "2.0.0", new)
    old_ppo = {"trl/experimental/ppo/ppo_config.py": experimental.format("PPOConfig", "kl_coef")}
    older = fake_wheel(tmp_path / "old", "1.12.0", old_ppo)
    out = tmp_path / "fields.json"

    done = run_script(
        newest, "--older", older, "--transformers", tf / "training_args.py", "-o", out
    )
    assert done.returncode == 0, done.stderr
    doc = json.loads(out.read_text())
    assert doc["GRPOConfig"] == ["base_only", "own_grpoconfig"]  # inherited ones left out
    assert doc["DPOConfig"] == ["base_only", "beta", "own_sftconfig"]
    assert doc["PPOConfig"] == ["base_only", "kl_coef"]
    assert doc["ORPOConfig"] == ["base_only", "own_orpoconfig"]  # from trl/experimental/orpo
    assert doc["TrainingArguments"] == sorted(trl_fields.INHERITED)
    assert doc["_header"]["trl_version"] == "2.0.0"
    assert doc["_header"]["transformers_version"] == "9.9.9"
    assert doc["_header"]["sources"]["PPOConfig"].startswith("trl 1.12.0:")

    # without the older wheel PPOConfig is missing: an error, and no file written
    out.unlink()
    done = run_script(newest, "--transformers", tf / "training_args.py", "-o", out)
    assert done.returncode != 0 and "PPOConfig" in done.stderr
    assert not out.exists()
