"""The memory planner: a step's memory measured by category (memory), a whole job's step run under fake
tensors and a fake process group (simulate), the longest context that fits a GPU (fit), the tensors
at a plan's peak (breakdown), and the memory levers ``--memory auto`` picks from its plans (auto)."""
