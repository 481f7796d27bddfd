"""mccld's network: authenticated daemon links and their gate, the pooled data sockets and
the on-demand dialling that fills them, fleet gossip, switch topology, link tests."""
