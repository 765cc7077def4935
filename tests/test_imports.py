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


def test_planning_a_cpu_placement_imports_no_torch():
    """`memra-pp plan` and the driver's side of a CPU launch (the checkpoint's config and tensor names, the plan,
    the tokenizer, a stage's ContextId coming back from its setup, a request's checks) need no torch: it was 1.2 s
    of a 1.65 s `plan`, and of every `launch`, `generate` and `bench` process before its first Ray call."""
    code = ("import pickle\n"
            "from memra_pp.cli import main\n"
            "assert main(['plan', 'cluster_configs/tiny-cpu.yaml']) == 0\n"
            "from memra_pp.defaults import ensure_tiny\n"
            "from memra_pp.model.weights import open_weights\n"
            "from memra_pp.model.tokenizer import Tokenizer\n"
            "from memra_pp.placement import load_placement, make_plan\n"
            "from memra_pp.defaults import TINY_CPU\n"
            "src = open_weights(str(ensure_tiny()), 'auto')\n"
            "assert src.has('embed_tokens.weight')\n"
            "make_plan(load_placement(dict(TINY_CPU)), src.config)\n"
            "Tokenizer.for_model(str(ensure_tiny()))\n"
            "from memra_pp.engine import ContextId\n"
            "pickle.loads(pickle.dumps(ContextId('node', 1, 'cpu', 2)))\n"
            "from memra_pp.request import request_dict\n"
            "request_dict(dict(temperature=0.7, top_p=0.9, seed=3), prompt=[5, 17], max_new_tokens=4)\n")
    assert _loaded(code, ("torch",)) == []


def test_reading_a_gguf_files_config_imports_no_torch():
    """A GGUF placement's driver too: the file's config, tensor names and tokenizer without torch."""
    from test_gguf import _fixtures
    f = _fixtures() / "dense_text-s404" / "dense_text-f32.gguf"
    code = ("from memra_pp.model.weights import open_weights\n"
            "from memra_pp.model.tokenizer import Tokenizer\n"
            f"src = open_weights({str(f)!r}, 'auto')\n"
            "assert src.config.text.num_hidden_layers == 6 and src.has('layers.0.mlp.down_proj.weight')\n"
            f"Tokenizer.for_model({str(f)!r})\n")
    assert _loaded(code, ("torch",)) == []
