"""What a process pays to start: a stage process (its actor shell and runner) and the CLI import only what they
use. torch.nn.attention.bias pulled in torch._dynamo (1.2 s of every stage's start, a sixth of the suite); the CLI
answers --help and refusals before torch or Ray load."""
import subprocess
import sys

HEAVY = ("torch._dynamo", "torch._inductor", "transformers", "matplotlib")


def _loaded(code: str, names) -> list[str]:
    out = subprocess.run([sys.executable, "-c", f"{code}\nimport sys\nprint([m for m in {list(names)!r} "
                          f"if m in sys.modules])"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return eval(out.stdout.strip().splitlines()[-1])


def test_a_stage_process_imports_no_compiler_or_transformers():
    assert _loaded("import memra_pp.stages.actor, memra_pp.stages.runner", HEAVY) == []


def test_the_cli_module_imports_neither_torch_nor_ray():
    assert _loaded("import memra_pp.cli", ("torch", "ray") + HEAVY) == []


def test_the_stage_actor_class_imports_no_torch():
    """A client's ray.get_actor loads the stage actor's class to make a handle: the class's module must not bring
    torch (the runner is imported in the actor's __init__, in the stage; test_0_cli runs a CLI status through it)."""
    assert _loaded("import memra_pp.stages.actor", ("torch",) + HEAVY) == []
