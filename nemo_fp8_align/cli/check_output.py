"""What ``nemo-fp8-align check`` prints: the violations, the one override line that fixes them
(re-checked by composing the config again with it, as pasting it would), the plugin-off
alternative in the form the config needs, and notes; as text or as one JSON object
(``--format json``). Keys and fixes are written in the form the same command line accepts (the
``training.`` prefix on the launcher's ``conf/config.yaml``).
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any, Dict, List, Optional, TextIO

from nemo_fp8_align.config_check.fixes import FixLine, agreeing, fix_line, pasteable
from nemo_fp8_align.config_check.reader import Violation
from nemo_fp8_align.errors import ConfigLoadError

__all__ = ["Report"]

EXIT_OK, EXIT_INVALID = 0, 2
DP_FLAG = "--data-parallel-size"
OFF_KEY = "model.fp8_transpose_align.enabled"
_KEY_REF = re.compile(r"(?<![\w.])(model|trainer)\.")


class Report:
    """One run of the check for parsed ``args``, printing to ``out`` / ``err``."""

    def __init__(self, args: argparse.Namespace, out: TextIO, err: TextIO) -> None:
        self.args, self.out, self.err = args, out, err
        self.json = getattr(args, "format", "text") == "json"
        self.path = Path(args.config)
        self.source: Any = None
        self.cfg: Any = None

    # ------------------------------------------------------------------ entry points
    def error(self, message: str) -> int:
        if self.json:
            self._emit_json({"ok": False, "config": str(self.path), "error": message,
                             "violations": [], "fix_overrides": []})
        else:
            print(f"error: {message}", file=self.err)
        return EXIT_INVALID

    def run(self, source: Any, cfg: Any) -> int:
        self.source, self.cfg = source, cfg
        violations = self.find(cfg)
        if not violations:
            return self._ok()
        line = fix_line(violations, self.recheck, self.present)
        # each violation's fix is then the part of the line that sets its keys (never a value
        # the line replaces with another, e.g. VP 2 where the line, re-checked, says VP 3)
        violations = [replace(v, fix=agreeing(v.fix, line)) for v in violations]
        # Not a training config (or no model block): there is no plugin to turn off.
        shape = any(v.key in ("config", "model", "trainer") for v in violations)
        off = None if shape else self._plugin_off()
        if self.json:
            self._emit_json({"ok": False, "config": str(self.path),
                             "violations": [self._violation_dict(v) for v in violations],
                             "fix_overrides": [self.shown(o) for o in line.overrides],
                             "fix_passes": line.passes,
                             "found_on_recheck": [self._violation_dict(v, line)
                                                  for v in line.later],
                             "left": [self._violation_dict(v) for v in line.left],
                             "plugin_off": off, "notes": self._notes()})
        else:
            self._print_text(violations, line, off)
        return EXIT_INVALID

    # ------------------------------------------------------------------ the check itself
    def find(self, cfg: Any) -> List[Violation]:
        """The violations, each fix the fix search's (:data:`~.fix_search.FIX_SEARCH`)."""
        from nemo_fp8_align.config_check.check import find_violations
        from nemo_fp8_align.config_check.fix_search import FIX_SEARCH

        return find_violations(cfg, data_parallel_size=self.args.data_parallel_size,
                               data_parallel_name=DP_FLAG,
                               require_block=not getattr(self.args, "mixin", False),
                               mcore=getattr(self.args, "mcore_rules", None), fixer=FIX_SEARCH)

    def recheck(self, extra: List[str]) -> List[Violation]:
        """The violations of the same command line with ``extra`` appended as printed."""
        from nemo_fp8_align.cli.check_load import load_source

        try:
            _, cfg = load_source(self.path, [*self.args.overrides,
                                             *(self.shown(o) for o in extra)])
        except ConfigLoadError as error:
            return [Violation("<override line>", " ".join(extra), "a line Hydra composes",
                              f"none found automatically ({error})")]
        return self.find(cfg)

    def present(self, key: str) -> bool:
        """Whether dotted ``key`` is in the config as given (its training node, launcher)."""
        from omegaconf import DictConfig

        node: Any = self._node()
        for part in key.split("."):
            if not isinstance(node, DictConfig) or part not in [str(k) for k in node.keys()]:
                return False
            node = node._get_node(part)  # the child node itself: no interpolation resolved
        return True

    def _node(self) -> Any:
        """The config node the check reads (the training node of the launcher's config)."""
        if self.source is not None and self.source.kind == "launcher-main":
            return self.cfg._get_node("training")
        return self.cfg

    def shown(self, text: str) -> str:
        """``text`` (a key or overrides) in the form this command line accepts."""
        if self.source is not None and self.source.prefix:
            return _KEY_REF.sub(lambda m: f"{self.source.prefix}{m.group(1)}.", text)
        return text

    # ------------------------------------------------------------------ pieces
    def _plugin_off(self) -> Optional[str]:
        """The override that turns the plugin off, if re-checking it leaves nothing."""
        form = f"{OFF_KEY}=False" if self.present(OFF_KEY) else f"+{OFF_KEY}=False"
        if self.present("model.fp8_transpose_align") and \
                not self.present("model.fp8_transpose_align.policy") and \
                not self.present(OFF_KEY) and not self._block_is_mapping():
            form = f"~model.fp8_transpose_align +{OFF_KEY}=False"
        overrides = form.split()
        return self.shown(form) if not self.recheck(overrides) else None

    def _block_is_mapping(self) -> bool:
        from omegaconf import DictConfig

        model = self._node()._get_node("model")
        return isinstance(model, DictConfig) and isinstance(
            model._get_node("fp8_transpose_align"), DictConfig)

    def _notes(self) -> List[str]:
        note = getattr(self.args, "mcore_note", "")
        notes = [note] if note else []
        if self.source is not None and self.source.unread:
            notes.append("not read by the check (the launcher's own settings): "
                         + " ".join(self.source.unread))
        if self.source is not None and self.source.kind == "launcher-main":
            notes.append(f"checked training={self.source.choice} ({self.source.path})")
        from omegaconf import OmegaConf

        if OmegaConf.select(self._node(), "model.enable_cuda_graph",
                            throw_on_resolution_failure=False) is True:
            notes.append("model.enable_cuda_graph=True: per-layer CUDA graphs keep the chunks' "
                         "hooks outside the graphs, but NeMo's own graph machinery has not been "
                         "run with the plugin")
        return [self.shown(n) for n in notes]

    def _violation_dict(self, v: Violation, line: Optional[FixLine] = None) -> Dict[str, str]:
        fix = v.fix if line is None else agreeing(v.fix, line)
        return {"key": self.shown(v.key), "found": v.found, "expected": v.expected,
                "fix": self.shown(fix)}

    def _ok(self) -> int:
        from nemo_fp8_align.config_check.check import align_config_from, data_parallel_size_of

        align = align_config_from(self.cfg)
        if not align.active:
            state = "plugin inactive, nothing to check"
        elif self.args.data_parallel_size is None and data_parallel_size_of(self.cfg) is None:
            state = (f"policy={align.policy.value}; microbatch checks skipped: data-parallel "
                     f"size unknown, pass {DP_FLAG}")
        else:
            state = f"policy={align.policy.value}"
        notes = self._notes()
        if self.json:
            self._emit_json({"ok": True, "config": str(self.path), "state": state,
                             "violations": [], "fix_overrides": [], "notes": notes})
        else:
            print(f"{self.path}: OK ({state})", file=self.out)
            for note in notes:
                print(f"  note: {note}", file=self.out)
        return EXIT_OK

    def _print_text(self, violations: List[Violation], line: FixLine, off: Optional[str]) -> None:
        print(f"{self.path}: {len(violations)} setting(s) stop the aligned FP8-transpose plugin "
              "(model.fp8_transpose_align) from working:", file=self.out)
        for v in violations:
            print(f"  - {self.shown(v.key)}: found {v.found}; expected {v.expected} | fix: "
                  f"{self.shown(v.fix)}", file=self.out)
        if line.later:
            print("The re-check with the fixes above found more (in the line too):",
                  file=self.out)
            for v in line.later:
                print(f"  - {self.shown(v.key)}: found {v.found}; expected {v.expected} | fix: "
                      f"{self.shown(agreeing(v.fix, line))}", file=self.out)
        if line.passes:
            print("Fix them all with this override line (re-checked: the config passes with "
                  f"it):\n  {self.shown(line.text)}", file=self.out)
        else:
            if line.overrides:
                print(f"These overrides fix part of it (re-checked):\n  {self.shown(line.text)}",
                      file=self.out)
            left = line.left or [v for v in violations if pasteable(v.fix) is None]
            print("Still to decide by hand (no override line found that passes):",
                  file=self.out)
            for v in left:
                print(f"  - {self.shown(v.key)}: {v.expected} | {self.shown(v.fix)}",
                      file=self.out)
        for note in self._notes():
            print(f"note: {note}", file=self.out)
        if off is not None:
            print(f"Or turn the plugin off: {off}", file=self.out)

    def _emit_json(self, payload: Dict[str, Any]) -> None:
        print(json.dumps(payload, indent=None, sort_keys=False), file=self.out)
