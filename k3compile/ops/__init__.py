"""The ``k3::`` op library.

Every semantic unit of the model is a ``torch.library.custom_op`` in the ``k3``
namespace with a pure-torch reference implementation (the numerical truth, runs on
any device) and a fake implementation (shapes only, for export on meta/fake tensors).
Importing this package registers all ops; passes match them by name
(``torch.ops.k3.<name>``), never by module path.
"""
from k3compile.ops import kda  # noqa: F401
from k3compile.ops import activations, attn_res, mla, moe, norm, partial  # noqa: F401,E402
from k3compile.ops import dcp, kda_fused, mla_proj, moe_input  # noqa: F401,E402
