"""Reading media as the released code reads it, with PyAV: files (`files`), a video's frames (`video`, cutting H.264
and HEVC streams with `nal`'s syntax), its sound track (`sound`)."""
