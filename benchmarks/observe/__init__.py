"""What an operator watches, timed: ``rayckpt status`` against ``ray status`` on the same cluster."""
