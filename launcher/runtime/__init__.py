"""The mechanism below the backends: process handles and groups, local processes, labelled
output, and the hub that node agents report to. Every backend builds on these."""
