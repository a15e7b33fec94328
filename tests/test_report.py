"""``nemo-fp8-align report``: a demo run's telemetry judged and summarised; broken records
fail; unreadable input is a clear error."""

import json
from pathlib import Path

import pytest

from nemo_fp8_align.cli import main

DATA = Path(__file__).parent / "data"
ALIGNED = DATA / "telemetry_demo_pp2_vp2_dp2_aligned.jsonl"
LAZY = DATA / "telemetry_demo_pp2_vp2_dp2_lazy.jsonl"


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _chunk_line(out, chunk):
    return next(line for line in out.splitlines() if line.startswith(f"{chunk} "))


def test_report_on_demo_telemetry_aligned(capsys):
    assert main(["report", str(ALIGNED)]) == 0
    out = capsys.readouterr().out
    assert "pipeline ranks 0,1, data-parallel ranks 0,1, policy aligned" in out
    assert "r0:[0] r1:[0]" in _chunk_line(out, 0)
    assert "r0:[2] r1:[2]" in _chunk_line(out, 1)
    # these records carry no pp_size/vp_size/dp_size: completeness is not claimed
    assert "every record is there" not in out
    assert "(--pp-size N --vp-size N --dp-size N) to judge it. Not observed: " in out


def test_report_on_demo_telemetry_lazy(capsys):
    assert main(["report", str(LAZY)]) == 0
    out = capsys.readouterr().out
    assert "r0:[2] r1:[3]" in _chunk_line(out, 1)  # each rank at its own first use


def test_report_per_rank_files(tmp_path, capsys):
    # NeMo writes one file per rank ({rank} in telemetry_path): the report takes them all.
    rows = _rows(ALIGNED)
    paths = []
    for rank in (0, 1):
        p = tmp_path / f"t.rank{rank}.jsonl"
        p.write_text("".join(json.dumps(r) + "\n" for r in rows if r["pp_rank"] == rank))
        paths.append(str(p))
    assert main(["report", *paths]) == 0
    capsys.readouterr()
    assert main(["report", paths[0]]) == 0  # one rank alone is consistent, but not complete
    out = capsys.readouterr().out
    assert "completeness not judged" in out and "every record is there" not in out


@pytest.mark.parametrize("field,value,needle", [
    ("slot", 1, "transposes at slot 1, aligned slot is 0"),
    ("after_all_gather", False, "before the chunk's all-gather finished"),
    ("valid", 3, "3 of 4 transposes valid"),
    ("t_gathered", 0.0, "timestamps out of order"),
])
def test_report_fails_on_broken_records(tmp_path, capsys, field, value, needle):
    rows = _rows(ALIGNED)
    rows[0][field] = value
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["report", str(path)]) == 1
    assert needle in capsys.readouterr().out


def test_report_duplicate_record_fails(tmp_path, capsys):
    rows = _rows(ALIGNED)
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows + rows[:1]))
    assert main(["report", str(path)]) == 1
    assert "2 records, expected exactly 1" in capsys.readouterr().out


def test_report_timings_from_timestamps(tmp_path, capsys):
    rows = _rows(ALIGNED)
    for r in rows:
        r.update(t_launch=9.0, t_slot=10.0, t_gathered=10.002, t_done=10.005, t_first_use=10.01)
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["report", str(path)]) == 0
    line = _chunk_line(capsys.readouterr().out, 0)
    assert "r0:3.000 r1:3.000" in line and "r0:2.000 r1:2.000" in line


def test_report_reads_records_without_timestamps(tmp_path, capsys):
    # Telemetry from before the valid count and the timestamps: still judged and printed.
    keep = ("step", "pp_rank", "dp_rank", "chunk", "policy", "backend", "vmid", "slot",
            "aligned_slot", "transposed", "weights", "after_all_gather", "seconds")
    rows = [{k: r[k] for k in keep} for r in _rows(ALIGNED)]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["report", str(path)]) == 0
    out = capsys.readouterr().out
    assert "without t_slot/t_gathered/t_done" in out and "r0:[2] r1:[2]" in _chunk_line(out, 1)


@pytest.mark.parametrize("content,needle", [
    ("{not json\n", "t.jsonl:1: not JSON"),
    ('{"step": 0}\n', "t.jsonl:1: not a transpose record, missing pp_rank"),
    ("", "no records in"),
])
def test_report_bad_input(tmp_path, capsys, content, needle):
    path = tmp_path / "t.jsonl"
    path.write_text(content)
    assert main(["report", str(path)]) == 2
    assert needle in capsys.readouterr().err


def test_report_mixed_policies(tmp_path, capsys):
    assert main(["report", str(ALIGNED), str(LAZY)]) == 2
    assert "several policies" in capsys.readouterr().err


def test_report_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "slots.png"
    assert main(["report", str(LAZY), "--plot", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 10000


@pytest.mark.slow
def test_report_on_a_fresh_demo_run(tmp_path, capsys):
    pytest.importorskip("megatron.core")
    telemetry = tmp_path / "t.jsonl"
    from lab.demo.cli import main as demo_main

    assert demo_main(["--pp", "2", "--vp", "2", "--dp", "2", "--microbatches", "4",
                 "--steps", "2", "--telemetry", str(telemetry)]) == 0
    capsys.readouterr()
    assert main(["report", str(telemetry)]) == 0
    assert "r0:[2] r1:[2]" in _chunk_line(capsys.readouterr().out, 1)


# --- issue 25 item 5: fields cross-checked, completeness only where judged, the A/B footnote --

OBSERVED = DATA / "telemetry_observed_pp2_vp2_dp2_aligned.jsonl"
OBSERVED_LAZY = DATA / "telemetry_observed_pp2_vp2_dp2_lazy.jsonl"


def _late_chunk(rows):
    """pp rank 1's chunk-1 record of step 0 (aligned slot 2, observed before its forward 1)."""
    return next(r for r in rows if (r["step"], r["chunk"], r["pp_rank"], r["dp_rank"]) == (0, 1, 1, 0))


@pytest.mark.parametrize("change,needle", [
    ({"obs_slot": 1}, "obs_slot 1 disagrees with obs_at [[1, false]]: its first position [1, false] is slot 2"),
    ({"vmid": 0}, "slot 2 disagrees with vmid 0"),
    ({"obs_at": [[1, False], [1, False]]}, "repeats a position"),
    ({"obs_at": [], "obs_slot": None}, "obs_built 5 with no position in obs_at"),
    ({"obs_built": None}, "without obs_built"),
])
def test_report_fails_on_fields_that_contradict_each_other(tmp_path, capsys, change, needle):
    rows = _rows(OBSERVED)
    _late_chunk(rows).update(change)
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["report", str(path)]) == 1
    out = capsys.readouterr().out
    failed = [line for line in out.splitlines() if line.startswith("FAILED: ")]
    assert any(line.startswith("FAILED: step 0 chunk 1 pp rank 1 dp rank 0: ") and needle in line
               for line in failed), out
    assert "OK:" not in out


def test_report_judges_completeness_of_older_records_only_with_the_sizes(tmp_path, capsys):
    rank0 = tmp_path / "t.rank0.jsonl"
    rank0.write_text("".join(json.dumps(r) + "\n" for r in _rows(ALIGNED) if r["pp_rank"] == 0))
    assert main(["report", str(rank0), "--pp-size", "2", "--vp-size", "2", "--dp-size", "2"]) == 1
    assert "pipeline rank 1 wrote no records (of PP=2)" in capsys.readouterr().out
    assert main(["report", str(ALIGNED), "--pp-size", "2", "--vp-size", "2", "--dp-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "every record of steps 0-2 is there" in out and "global ranks not judged" in out


def test_report_observed_records_claim_completeness(capsys):
    assert main(["report", str(OBSERVED)]) == 0
    assert ("every record of steps 0-2 is there (every rank, one record per step/chunk/rank). "
            "Not observed: any step after step 2") in capsys.readouterr().out


def test_report_baseline_footnote_follows_the_data(capsys):
    assert main(["report", str(OBSERVED_LAZY), "--baseline", str(OBSERVED)]) == 0
    note = next(line for line in capsys.readouterr().out.splitlines()
                if line.startswith("(slot skew"))
    assert "A (lazy): pipeline ranks up to 1 slot apart on chunks 0, 1" in note
    assert "B (aligned): 0 on every chunk" in note and "observed slots" in note


@pytest.mark.parametrize("path,status", [
    (OBSERVED, 0), (DATA / "telemetry_observed_pp2_vp2_dp2_slot_shift_unreported.jsonl", 1)],
    ids=["ok", "failed"])
def test_report_into_a_closed_pipe_exits_with_its_own_status(path, status):
    # `report ... | head -1`: the reader is gone before the command writes; no traceback,
    # and the status is the verdict's (was a BrokenPipeError traceback and exit 1).
    import subprocess
    import sys

    run = subprocess.Popen([sys.executable, "-m", "nemo_fp8_align", "report", str(path)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           cwd=Path(__file__).parent.parent)
    run.stdout.close()
    err = run.stderr.read().decode()
    assert run.wait(timeout=120) == status and err == "", err


def _four_ranks(rows):
    """The PP=2 records with pipeline ranks 2 and 3 added (copies of 0 and 1): four ranks'
    timings in one cell, wider than the table's old fixed columns."""
    return rows + [{**r, "pp_rank": r["pp_rank"] + 2} for r in rows]


def test_report_columns_stay_apart_with_four_pipeline_ranks():
    from nemo_fp8_align.cli.report import format_report

    table, _ = format_report(_four_ranks(_rows(ALIGNED)))
    lines = table.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("chunk"))
    starts = [lines[header].index(name) for name in
              ("slot per pp rank", "transposes ms", "all-gather wait ms", "valid/weights")]
    rows = [line for line in lines[header + 1:] if line[:1].isdigit()]
    assert len(rows) == 2
    for line in rows:  # every cell starts under its heading, after a gap
        for at in starts:
            assert line[at - 2:at] == "  " and line[at] != " ", (at, line)
        for left, right in zip(starts[1:], starts[2:]):  # the fourth rank's time in its cell
            assert line[left:right].split()[-1].startswith("r3:"), line


def test_report_says_why_nothing_was_observed():
    from nemo_fp8_align.cli.report import format_report

    rows = _rows(ALIGNED)  # records without the observed fields
    assert "(observation off, or telemetry of an older version)" in format_report(rows)[0]
    empty = [{**r, "weights": 0, "transposed": 0, "valid": 0} for r in rows]
    assert "(no FP8 weight in them, so no build to observe)" in format_report(empty)[0]
