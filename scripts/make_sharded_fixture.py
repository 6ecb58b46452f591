"""Write tests/fixtures/sharded-cc9/: a sharded artifact (2 x 4 mesh) that jax 0.6.2 can read, and its expected results.

jax >= 0.9.1 writes the device count only in a field jax <= 0.7 does not read
(it sees 0 devices); the manifest's ``nr_devices`` is what such a jax then runs
with. Run it under the newest jax with 8 CPU devices and calling convention 9,
the newest jax 0.6.2 reads:

    JAX_EXPORT_CALLING_CONVENTION_VERSION=9 XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        .venv/bin/python scripts/make_sharded_fixture.py

tests/sharded/test_sharded_compat.py loads it under whatever jax runs the suite.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "samples" / "sharded"))

import block  # noqa: E402
import jax  # noqa: E402

import vjpsplit_cli as vs  # noqa: E402
from fixture_files import save_expected  # noqa: E402


def main() -> int:
    assert jax.device_count() >= 8, "set XLA_FLAGS=--xla_force_host_platform_device_count=8"
    out = ROOT / "tests" / "fixtures" / "sharded-cc9"
    out.mkdir(parents=True, exist_ok=True)
    specs = (block.mlp_params(), block.batch())
    art = vs.export(block.mlp, *specs, platforms="cpu", name="fixture:sharded_mlp")
    assert art.manifest.calling_convention_version == 9, "set JAX_EXPORT_CALLING_CONVENTION_VERSION=9"
    art.save(out / "mlp.vjps")
    params, x = block.init(specs[0], 5), block.init(specs[1], 6, b=4)
    value, (g_params, g_x) = jax.value_and_grad(block.mlp, argnums=(0, 1))(params, x)
    save_expected(out / "expected.npz", params, x, value, g_params, g_x)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
