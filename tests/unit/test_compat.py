"""torch's private names live in `pipetrain.compat` only, every one listed in `PRIVATE_NAMES` still exists in this
torch (fails loudly, naming it, when an upgrade moves one), and compat's pipelining helpers give plain data."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from pipetrain.compat import PRIVATE_NAMES
from pipetrain.compat.dtensor import PLACEMENT_COLLECTIVES
from pipetrain.compat.pipelining import torch_schedule_order

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "pipetrain"


@pytest.mark.parametrize("module,name", PRIVATE_NAMES, ids=[f"{m}.{n}" for m, n in PRIVATE_NAMES])
def test_private_torch_name_exists(module, name):
    target = importlib.import_module(module)
    for part in name.split("."):
        assert hasattr(target, part), f"torch moved {module}.{name}: update pipetrain/compat and PRIVATE_NAMES"
        target = getattr(target, part)


def test_the_wrapped_placement_methods_are_listed():
    listed = set(PRIVATE_NAMES)
    assert all(("torch.distributed.tensor.placement_types", f"{cls}.{method}") in listed
               for cls, method, _ in PLACEMENT_COLLECTIVES)


def _torch_names(tree: ast.Module) -> set[str]:
    """The local names a module binds to torch: `import torch`, `import torch.x as y`, `from torch.x import y`."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.asname or alias.name.split(".")[0] for alias in node.names if alias.name.startswith("torch")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch" and not node.level:
            names |= {alias.asname or alias.name for alias in node.names}
    return names


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_uses(path: Path) -> list[str]:
    """Where a module names a private torch name: imported from torch, reached as an attribute of a torch name
    (`torch._foreach_mul_`, `nn.modules.dropout._DropoutNd`), or a `_method` overridden in a subclass of a torch
    class that has it."""
    tree = ast.parse(path.read_text(), str(path))
    torch_names, uses = _torch_names(tree), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            uses += [f"{path.name}:{node.lineno} imports {alias.name}" for alias in node.names if _private(alias.name)]
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in torch_names:
                uses.append(f"{path.name}:{node.lineno} uses .{node.attr} of {root.id}")
        elif isinstance(node, ast.ClassDef):
            bases = [ast.unparse(b) for b in node.bases if ast.unparse(b).split(".")[0] in torch_names]
            methods = [f.name for f in node.body if isinstance(f, ast.FunctionDef) and _private(f.name)]
            for base in bases:
                cls = _resolve(tree, base)
                uses += [f"{path.name}:{node.lineno} {node.name} overrides {base}.{m}" for m in methods
                         if cls is not None and hasattr(cls, m)]
    return uses


def _resolve(tree: ast.Module, dotted: str):
    """The torch object a dotted name of the module stands for (None when it cannot be found)."""
    head, *rest = dotted.split(".")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            for alias in node.names:
                if (alias.asname or alias.name) == head:
                    obj = getattr(importlib.import_module(node.module), alias.name, None)
                    break
            else:
                continue
            break
        if isinstance(node, ast.Import):
            hits = [a for a in node.names if (a.asname or a.name.split(".")[0]) == head and a.name.startswith("torch")]
            if hits:
                obj = importlib.import_module(hits[0].name if hits[0].asname else head)
                break
    else:
        return None
    for part in rest:
        obj = getattr(obj, part, None)
    return obj


def test_private_torch_names_only_in_compat():
    outside = [use for path in sorted(PACKAGE.rglob("*.py")) if "compat" not in path.relative_to(PACKAGE).parts
               for use in _private_uses(path)]
    assert not outside, "private torch names outside pipetrain/compat:\n" + "\n".join(outside)


def test_the_scan_finds_each_kind_of_private_use(tmp_path):
    """The scan can fail: an import, an attribute and an override of a private torch name are each found."""
    module = tmp_path / "m.py"
    module.write_text("import torch\nfrom torch import nn\nfrom torch.distributed.pipelining.schedules import _Action\n"
                      "x = torch._foreach_mul_\nclass Style(nn.MultiheadAttention):\n"
                      "    def _reset_parameters(self):\n        pass\n    def _mine(self):\n        pass\n")
    uses = sorted(_private_uses(module))
    assert uses == ["m.py:3 imports _Action", "m.py:4 uses ._foreach_mul_ of torch",
                    "m.py:5 Style overrides nn.MultiheadAttention._reset_parameters"]


def test_torch_order_is_plain_data():
    order = torch_schedule_order("gpipe", 2, 2)
    assert order == [
        [(0, "F", 0), (0, "F", 1), (0, "B", 0), (0, "B", 1), (0, "R", -1)],
        [(1, "F", 0), (1, "F", 1), (1, "B", 0), (1, "B", 1), (1, "R", -1)],
    ]
    with pytest.raises(ValueError):
        torch_schedule_order("dualpipe", 2, 2)


def test_torch_v_orders_are_plain_data_with_fused_pairs():
    """DualPipeV's OVERLAP_F_B comes out as its two sub-actions, the forward marked fused; ZB-V has none."""
    order = torch_schedule_order("dualpipev", 2, 4)
    fused = [(rank, i) for rank, actions in enumerate(order) for i, a in enumerate(actions) if len(a) == 4]
    assert fused and all(order[r][i][1:] == ("F", order[r][i][2], True) and order[r][i + 1][1] == "B"
                         for r, i in fused)
    assert all(len(a) == 3 for actions in torch_schedule_order("zbv", 2, 4) for a in actions)
    assert {a[0] for a in torch_schedule_order("zbv", 2, 4)[0]} == {0, 3}  # rank 0 holds stages 0 and 2p-1


def test_torch_lowering_refuses_an_order_that_misses_actions():
    from pipetrain.compat.pipelining import torch_lowers

    assert torch_lowers("zbv", 2, 1)
    with pytest.raises(AssertionError):
        torch_lowers("dualpipev", 2, 2)  # fewer than 2p - 1: torch's generator runs extra forwards


def test_in_backward_sees_the_backward_and_a_recomputed_forward_not_the_forward():
    """`compat.overlap.in_backward` picks the expert-parallel group of an exchange: False in a forward, True in a
    backward's function and in the forward that checkpointing recomputes during the backward."""
    import torch
    from torch.utils.checkpoint import checkpoint

    from pipetrain.compat.overlap import in_backward

    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            seen.append(("forward", in_backward()))
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            seen.append(("backward", in_backward()))
            return grad

    x = torch.ones(3, requires_grad=True)
    checkpoint(lambda t: Probe.apply(t) ** 2, x, use_reentrant=False).sum().backward()  # pow saves: recomputed
    assert seen == [("forward", False), ("forward", True), ("backward", True)]
    assert not in_backward()
