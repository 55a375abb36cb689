"""Run the kernel tests in the order of docs/DESIGN.md's sections (§2 → §5)."""

DESIGN_ORDER = ["test_rng", "test_sampling", "test_speculative", "test_retention", "test_routing", "test_moe"]


def pytest_collection_modifyitems(items):
    def rank(item):
        name = item.module.__name__.rsplit(".", 1)[-1] if item.module else ""
        return DESIGN_ORDER.index(name) if name in DESIGN_ORDER else len(DESIGN_ORDER)

    items.sort(key=rank)  # stable: keeps file order within a module
