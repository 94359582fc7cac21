"""Everything that crosses a process boundary: authenticated frames, typed channels, the
cluster secret, dropped-frame counting, tokenizer files. Imports neither server nor cluster."""
from deepinfer.wire.channel import ChannelReceiver, ChannelSender, channel_name
from deepinfer.wire.drops import PROCESS_DROPS, DropCounter
from deepinfer.wire.frame import FrameDropped, FrameSigner, FrameVerifier
from deepinfer.wire.secret import SECRET_ENV, cluster_key, ensure_cluster_secret
from deepinfer.wire.tokenizer_files import (TokenizerFiles, tokenizer_from_files,
                                            tokenizer_to_files)

__all__ = ["ChannelReceiver", "ChannelSender", "channel_name", "PROCESS_DROPS", "DropCounter",
           "FrameDropped", "FrameSigner", "FrameVerifier", "SECRET_ENV", "cluster_key",
           "ensure_cluster_secret", "TokenizerFiles", "tokenizer_from_files",
           "tokenizer_to_files"]
