"""EdgeMoE: experts on flash, non-expert weights resident, an expert cache under a memory budget."""
