"""What a user runs beside training: the memory plan, --bench, --compare, --engine trl, and a run's figures."""
