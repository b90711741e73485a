"""The experiment's own tuning (``options.py``, ``TritonOptions``) as the config sets it,
``model.kernels.impl_options.triton``: the core keeps it unread, the implementation checks
it as the model's args are validated (whatever ``model.attn_impl`` is, so a run that falls
back keeps a checked section) and its kernels read it from the model's tuning."""

import pytest

from mta_repro.errors import UserError
from mta_repro.experimental.fused_triton import options
from mta_repro.train.config import compose, to_train_config


def _kernels(*overrides):
    return to_train_config(compose(["attention=mta", "model.attn_impl=triton", *overrides])).model.kernels


def test_the_options_compose_from_the_command_line_and_reach_the_kernels():
    kernels = _kernels(
        "+model.kernels.impl_options.triton.frame=128x64", "+model.kernels.impl_options.triton.programs=3"
    )
    got = options.of(kernels)
    assert (got.frame, got.frame_shape, got.programs, got.slab_rows) == ("128x64", (128, 64), 3, None)
    assert options.of(_kernels()) == options.TritonOptions()  # none set: the kernels' defaults
    assert options.kernel_tuning(frame="128x64", programs=3) == kernels


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "fram=64x64",
            "model.kernels.impl_options.triton.fram: no option of attention implementation 'triton' (did "
            "you mean frame?); its options: frame, programs, slab_rows",
        ),
        (
            "frame=24x32",
            "model.kernels.impl_options.triton.frame: '24x32': both sizes must be powers of two, at least "
            "16 (e.g. 128x64)",
        ),
        ("slab_rows=3", "model.kernels.impl_options.triton.slab_rows: 3: expected a power of two or null"),
        ("programs=0", "model.kernels.impl_options.triton.programs: 0: expected a positive integer or null"),
    ],
)
def test_a_wrong_option_is_one_line_naming_the_field_and_the_implementation(override, message):
    with pytest.raises(UserError) as e:
        _kernels(f"+model.kernels.impl_options.triton.{override}")
    assert str(e.value) == message
    with pytest.raises(UserError):  # also where another implementation runs
        to_train_config(compose([f"+model.kernels.impl_options.triton.{override}"]))
