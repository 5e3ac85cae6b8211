"""`turnopd new env NAME` / `turnopd new teacher NAME`: the files of a new env or teacher, rendered
from the templates in turnopd/scaffold/templates.

Each template folder mirrors the repository layout; `{{name}}` (the env name) and `{{Name}}` (its
CamelCase class prefix) are replaced in paths and contents, and `.tmpl` is dropped:

    env/          envs/NAME/{__init__,spec,env,prompt,expert}.py and tests/envs/test_NAME.py
    package/      an installable env plugin outside the checkout (`new env NAME --package DIR`):
                  pyproject.toml (the `turnopd.envs` entry point) and turnopd_NAME/__init__.py, a
                  complete small env to replace with one's own
    teacher/      teachers/NAME/teacher.yaml
    sft_recipe/   recipes/NAME/teacher_sft.yaml (both commands write it; kept when it exists)

Nothing is ever overwritten: the command checks every file first and writes none when one exists.
`new env` also adds the package to BUILTIN_ENVS in envs/__init__.py (the import that registers it),
because nothing else (`turnopd env`, the generated test, recipes) can find an env that is not
imported; it prints the line to add when that assignment is not a tuple of strings it can rewrite.
"""

from __future__ import annotations

import ast
import keyword
import re
from dataclasses import dataclass, field
from pathlib import Path

TEMPLATES = Path(__file__).parent / "templates"
TEMPLATE_SUFFIX = ".tmpl"
NAME_RE = re.compile(r"[a-z][a-z0-9_]*")
PLACEHOLDER_RE = re.compile(r"\{\{\s*\w+\s*\}\}")
MAX_LINE = 110  # the project's line length (pyproject's ruff config)


class ScaffoldError(ValueError):
    """A name or a target that the scaffold refuses, with what to do instead."""


@dataclass
class Scaffold:
    """What a `turnopd new` command did, paths relative to the repository root."""

    created: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # existed already, left as they are
    registered: bool = False  # BUILTIN_ENVS now lists the env (new env only)
    register_line: str = ""  # the BUILTIN_ENVS line to add by hand when the scaffold could not


def default_root() -> Path:
    """The checkout this `turnopd` runs from: the folder holding the imported `envs` package, which is
    where a new env must live for `import envs.NAME` to find it."""
    import envs

    return Path(envs.__file__).resolve().parent.parent


def class_prefix(name: str) -> str:
    """`my_env` -> `MyEnv`: the prefix of the generated classes (MyEnvSpec, MyEnvEnv, MyEnvExpert)."""
    return "".join(part.capitalize() for part in name.split("_"))


def known_envs(root: Path) -> set[str]:
    """Registered envs plus the env packages on disk under root (which may be another checkout)."""
    from envs import ENVS

    on_disk = {p.parent.name for p in (root / "envs").glob("*/__init__.py")}
    return set(ENVS.names()) | on_disk


def check_new_env_name(name: str, root: Path) -> None:
    if not NAME_RE.fullmatch(name) or keyword.iskeyword(name):
        raise ScaffoldError(f"env name {name!r}: use a lower-case Python identifier (letters, digits, _; "
                            "starting with a letter), e.g. twx or science_world")
    if name in known_envs(root):
        raise ScaffoldError(f"env {name!r} exists already (envs/{name}); choose another name")
    taken = [p for p in (root / "envs" / name, root / "envs" / f"{name}.py") if p.exists()]
    if taken:
        raise ScaffoldError(f"env name {name!r} is taken by {taken[0].relative_to(root)}; choose another name")


def check_teacher_name(name: str, root: Path) -> None:
    """A teacher spec is routed by env name (a distillation recipe's `teachers.<env>`): NAME must be
    an env."""
    envs = known_envs(root)
    if name not in envs:
        raise ScaffoldError(f"no env {name!r} to make a teacher for; envs: {', '.join(sorted(envs))} "
                            f"(`turnopd new env {name}` scaffolds one)")


def render(text: str, name: str) -> str:
    out = text.replace("{{name}}", name).replace("{{Name}}", class_prefix(name))
    left = PLACEHOLDER_RE.search(out)
    if left:  # a template typo, not a user error
        raise RuntimeError(f"unknown placeholder {left.group(0)} in a scaffold template")
    return out


def planned_files(kit: str, name: str) -> dict[str, Path]:
    """Target path (relative to the root) -> template file, for one template folder."""
    base = TEMPLATES / kit
    return {render(str(t.relative_to(base)), name).removesuffix(TEMPLATE_SUFFIX): t
            for t in sorted(base.rglob(f"*{TEMPLATE_SUFFIX}"))}


def write_files(root: Path, name: str, required: str, optional: str | None = None) -> Scaffold:
    """Render the `required` kit (refused if any of its files exists) and the `optional` one, if any
    (each file written unless it exists)."""
    must = planned_files(required, name)
    existing = [target for target in must if (root / target).exists()]
    if existing:
        raise ScaffoldError(f"refusing to overwrite {', '.join(existing)} (nothing written)")
    result = Scaffold()
    for target, template in {**must, **(planned_files(optional, name) if optional else {})}.items():
        path = root / target
        if path.exists():
            result.kept.append(target)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(render(template.read_text(), name))
        result.created.append(target)
    return result


def add_builtin_env(init_file: Path, module: str) -> bool:
    """Append `module` to the BUILTIN_ENVS tuple of envs/__init__.py, on one line while it fits the
    line length, else one module per line. False (the file left as it is) when the assignment is not a
    tuple of strings."""
    source = init_file.read_text()
    for node in ast.parse(source).body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name) and node.targets[0].id == "BUILTIN_ENVS"):
            continue
        try:
            modules = ast.literal_eval(node.value)
        except ValueError:
            return False
        if not (isinstance(modules, tuple) and all(isinstance(m, str) for m in modules)):
            return False
        if module in modules:
            return True
        lines = source.splitlines(keepends=True)
        head = lines[node.lineno - 1][: node.value.col_offset]
        tail = lines[node.end_lineno - 1][node.value.end_col_offset:]
        names = [f'"{m}"' for m in (*modules, module)]
        value = "(" + ", ".join(names) + ")"
        if len(head + value + tail.rstrip("\n")) > MAX_LINE:
            value = "(\n" + "".join(f"    {name},\n" for name in names) + ")"
        lines[node.lineno - 1 : node.end_lineno] = [head + value + tail]
        init_file.write_text("".join(lines))
        return True
    return False


def new_env(name: str, root: Path | None = None) -> Scaffold:
    """Scaffold env NAME (package, test, SFT recipe) and register it in BUILTIN_ENVS."""
    root = root or default_root()
    check_new_env_name(name, root)
    result = write_files(root, name, required="env", optional="sft_recipe")
    module = f"envs.{name}"
    result.registered = add_builtin_env(root / "envs" / "__init__.py", module)
    if not result.registered:
        result.register_line = f'add "{module}" to BUILTIN_ENVS in envs/__init__.py'
    return result


def new_env_package(name: str, folder: Path) -> Scaffold:
    """Scaffold env NAME as an installable package in `folder` (outside the checkout): it registers
    through its entry point once pip-installed, with no file of the checkout changed."""
    check_new_env_name(name, default_root())
    return write_files(folder, name, required="package")


def new_teacher(name: str, root: Path | None = None) -> Scaffold:
    """Scaffold the teacher spec of env NAME (and its SFT recipe when it has none)."""
    root = root or default_root()
    check_teacher_name(name, root)
    return write_files(root, name, required="teacher", optional="sft_recipe")
