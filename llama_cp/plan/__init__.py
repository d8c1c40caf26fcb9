"""The memory planner: a whole job's step run under fake tensors and a fake process group (memory), and
the memory levers ``--memory auto`` picks from its plans (auto)."""
