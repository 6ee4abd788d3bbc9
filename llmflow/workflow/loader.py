"""Read a workflow file and its ``extends:``/``include:`` recipes into one ``Workflow``.

Order of composition for a file F:
  1. each ``extends:`` base (in order; a later base overrides an earlier one);
  2. each ``include:`` file is added: its params and stages must not clash with anything else;
  3. F's own ``params``/``stages`` override the bases: params merge field by field (a child may
     change only ``default``), stages merge by id with ``with:`` merged key by key; a child stage
     may replace ``uses`` (then the base's ``with:`` is dropped) or ``needs``.
Each file is checked against the structural schema on its own, so every error points into the
file that has it. Problems are collected, not raised one at a time.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmflow.workflow.marks import Mark, MarkMap, ValidationError, WorkflowError, load_yaml
from llmflow.workflow.model import StageSpec, Workflow
from llmflow.workflow.schema import schema_errors, structural_schema

MAX_RECIPE_DEPTH = 32  # files deep through include:/extends: (each is a level of recursion)


@dataclass
class _Doc:
    """The merged ``params``/``stages`` of one file and its recipes, with marks and uses dirs."""

    data: dict[str, Any] = field(default_factory=lambda: {"params": {}, "stages": {}})
    marks: MarkMap = field(default_factory=MarkMap)
    uses_dirs: dict[str, Path] = field(default_factory=dict)  # stage id -> dir of its `uses` file
    included: set[tuple[str, str]] = field(default_factory=set)  # (section, name) added by include:


class _Loader:
    def __init__(self) -> None:
        self.errors: list[ValidationError] = []
        self.files: list[str] = []
        self._schema = structural_schema()

    def load(self, path: Path, display: str, stack: tuple[Path, ...] = ()) -> _Doc | None:
        data, marks, errors = load_yaml(path, display)
        self.files.append(display)
        self.errors += errors
        if errors or data is None:
            return None
        if not isinstance(data, dict):
            self.errors.append(ValidationError("a workflow file must be a mapping", marks.value(())))
            return None
        shape = schema_errors(self._schema, data, marks)
        if shape:
            self.errors += shape
            return None
        doc = _Doc()
        stack = (*stack, path.resolve())
        bases = data.get("extends", [])
        for i, rel in enumerate([bases] if isinstance(bases, str) else bases):
            sub = self._child(
                path,
                display,
                rel,
                marks.value(("extends", i) if not isinstance(bases, str) else ("extends",)),
                stack,
            )
            if sub is not None:
                self._override(doc, sub)
        for i, rel in enumerate(data.get("include", [])):
            sub = self._child(path, display, rel, marks.value(("include", i)), stack)
            if sub is not None:
                self._add(doc, sub)
        own = _Doc(
            {
                "params": data.get("params", {}),
                "stages": data.get("stages", {}),
                **{k: data[k] for k in ("name", "description") if k in data},
            },
            marks,
        )
        for sid, stage in own.data["stages"].items():
            if "uses" in stage:
                own.uses_dirs[sid] = path.parent
        if len(stack) > 1:  # a base or include: its path defaults name files beside it
            _anchor_path_defaults(own.data["params"], path.parent)
        for section, name in doc.included:
            if name in own.data[section]:
                what = "param" if section == "params" else "stage"
                self.errors.append(
                    ValidationError(
                        f"{what} {name!r} is defined twice (also at {doc.marks.key((section, name))}, "
                        "an include: use extends: to override)",
                        own.marks.key((section, name)),
                    )
                )
                del own.data[section][name]
        self._override(doc, own)
        return doc

    def _child(
        self, path: Path, display: str, rel: str, mark: Mark | None, stack: tuple[Path, ...]
    ) -> _Doc | None:
        target = (path.parent / rel).expanduser()
        shown = os.path.normpath(os.path.join(os.path.dirname(display), rel))
        if not target.is_file():
            self.errors.append(ValidationError(f"file not found: {rel!r} (looked for {target})", mark))
            return None
        if target.resolve() in stack:
            chain = " -> ".join([*(p.name for p in stack), target.name])
            self.errors.append(ValidationError(f"include cycle: {chain}", mark))
            return None
        if len(stack) >= MAX_RECIPE_DEPTH:
            self.errors.append(
                ValidationError(f"include/extends chain deeper than {MAX_RECIPE_DEPTH} files", mark)
            )
            return None
        return self.load(target, shown, stack)

    def _add(self, doc: _Doc, sub: _Doc) -> None:
        """``include:``: union, a clash of ids is an error naming both places."""
        taken: list[tuple] = []  # (the marks are copied in one pass at the end: see MarkMap.drop)
        for section in ("params", "stages"):
            for name, value in sub.data[section].items():
                if name in doc.data[section]:
                    what = "param" if section == "params" else "stage"
                    first = doc.marks.key((section, name))
                    self.errors.append(
                        ValidationError(
                            f"{what} {name!r} is defined twice (also at {first})",
                            sub.marks.key((section, name)),
                        )
                    )
                    continue
                doc.data[section][name] = value
                doc.included.add((section, name))
                taken.append((section, name))
                if name in sub.uses_dirs:
                    doc.uses_dirs[name] = sub.uses_dirs[name]
        doc.marks.copy_from(sub.marks, *taken)

    def _override(self, doc: _Doc, sub: _Doc) -> None:
        """``extends:`` (and a file's own content): ``sub`` overrides ``doc``."""
        # the subtrees whose marks are replaced by sub's, and those whose marks go: applied in one
        # pass each at the end (disjoint paths, so the order does not matter; see MarkMap.drop)
        replaced: list[tuple] = []
        dropped: list[tuple] = []
        for key in ("name", "description"):
            if key in sub.data:
                doc.data[key] = sub.data[key]
                replaced.append((key,))
        for section in ("params", "stages"):
            for name, value in sub.data[section].items():
                old = doc.data[section].get(name)
                if old is None:
                    doc.data[section][name] = copy.deepcopy(value)
                    replaced.append((section, name))
                else:
                    replace_with = (
                        section == "stages" and "uses" in value and value["uses"] != old.get("uses")
                    )
                    for fkey, fval in value.items():
                        fpath = (section, name, fkey)
                        if fkey == "with" and not replace_with and isinstance(old.get("with"), dict):
                            for wkey, wval in fval.items():
                                old["with"][wkey] = copy.deepcopy(wval)
                                replaced.append((*fpath, wkey))
                        else:
                            old[fkey] = copy.deepcopy(fval)
                            replaced.append(fpath)
                    if replace_with and "with" not in value:
                        old.pop("with", None)
                        dropped.append((section, name, "with"))
                    doc.marks.keys[(section, name)] = sub.marks.key((section, name))
                if section == "stages" and name in sub.uses_dirs:
                    doc.uses_dirs[name] = sub.uses_dirs[name]
        doc.marks.drop(*replaced, *dropped)
        doc.marks.copy_from(sub.marks, *replaced)


def _anchor_path_defaults(params: dict[str, Any], folder: Path) -> None:
    """A ``format: path`` param's default in a recipe another file extends or includes, written
    relative to the recipe (``../plugins/demo_bug.py:f``), made absolute where it names a file
    beside it: the merged workflow reads relative paths from the top file's folder, where the
    recipe's would name nothing (or something else). Names (``smollm2``) and paths that are not
    there are left as written."""
    for spec in params.values():
        default = spec.get("default") if isinstance(spec, dict) and spec.get("format") == "path" else None
        if not isinstance(default, str) or not default.strip():
            continue
        text, sep, attr = default.rpartition(":") if default.rpartition(":")[0].endswith(".py") else \
            (default, "", "")
        if os.path.isabs(text) or text.startswith("~"):
            continue
        beside = folder / text
        if beside.exists():
            spec["default"] = os.path.normpath(str(beside.resolve())) + sep + attr


def load_workflow(path: str | Path) -> Workflow:
    """Load and merge a workflow file; raises ``WorkflowError`` (a UserError) with every problem
    in the files' shape. Semantic checks (stage types, needs, ${...}) are ``validate_workflow``'s."""
    display = os.path.normpath(str(path))
    file = Path(path).expanduser()
    if not file.is_file():
        raise WorkflowError([ValidationError(f"{display}: no such workflow file")])
    loader = _Loader()
    doc = loader.load(file.resolve(), display)
    if loader.errors or doc is None:
        raise WorkflowError(loader.errors)
    errors: list[ValidationError] = []
    stages: dict[str, StageSpec] = {}
    for sid, st in doc.data["stages"].items():
        if "uses" not in st:
            errors.append(
                ValidationError(
                    f"stage {sid!r} has no 'uses:' (a stage type)", doc.marks.key(("stages", sid))
                )
            )
            continue
        stages[sid] = StageSpec(
            sid,
            st["uses"],
            st.get("with", {}),
            list(st.get("needs", [])),
            st.get("description", ""),
            doc.uses_dirs.get(sid, file.resolve().parent),
        )
    for pname, spec in doc.data["params"].items():
        if "type" not in spec:
            errors.append(
                ValidationError(f"param {pname!r} has no 'type:'", doc.marks.key(("params", pname)))
            )
    if errors:
        raise WorkflowError(errors)
    return Workflow(
        path=file.resolve(),
        display=display,
        name=doc.data.get("name") or file.stem,
        description=doc.data.get("description", ""),
        params=doc.data["params"],
        stages=stages,
        marks=doc.marks,
        files=loader.files,
    )
