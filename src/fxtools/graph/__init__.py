"""What every stage knows about a torch.fx graph: node metadata (``meta``), small predicates and
helpers on nodes (``nodes``), and values whose shape depends on data (``data_dependent``)."""
