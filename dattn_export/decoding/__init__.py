"""Pictures and folders of frames as the released code opens them (`files`); video and audio files are read by the
code a Hub repo ships (`modeling/video_decoding.py`, `modeling/sound_decoding.py`)."""
