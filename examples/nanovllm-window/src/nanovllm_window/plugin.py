"""Entry point of ``nanovllm-window`` (group ``nanovllm``).

Registration only names lazy ``"module:Name"`` targets, so ``nanovllm plugins`` can list this
plugin without importing torch.
"""

from nanovllm.sparse import hookimpl


@hookimpl
def register_sparse_policies(registry) -> None:
    registry.add_sparse_policy(
        "window",
        "nanovllm_window.policy:WindowPolicy",
        config="nanovllm_window.config:WindowConfig",
        api_version="1.0",  # the policy API (nanovllm.sparse.API_VERSION) this plugin is written for
    )
